"""The prefix cache: a radix tree over token ids whose nodes own the KV slots of their tokens.

Many requests start alike: a system prompt, a few-shot preamble, the earlier turns of a
conversation. The K/V of a token depends only on the tokens before it, so two requests that share
their first n tokens may share those n slots, and the second computes only what comes after.
When a request finishes, its tokens and slots stay here instead of going back to the allocator
(its prompt comes in earlier, once prefilled: scheduler.py), and a later request that starts the
same way finds them (SGLang's RadixAttention, Zheng et al.,
"SGLang: Efficient Execution of Structured Language Model Programs", 2024).

Why a tree: cached sequences share prefixes, so we store each shared part once. A radix tree
(a trie whose chains are merged into one node per run of tokens) finds the longest cached prefix
of a prompt in one walk from the root, one step per node. Each node holds a run of token ids
(`key`) and the slots of their K/V (`slots`, same length); a path from the root spells a cached
sequence. With a page size of 1 every token has its own slot, so a match may end anywhere: when
it ends inside a node, we split the node in two and the match ends exactly on a node boundary.
(With pages of p tokens, matches and splits would have to round to pages.)

What a lock protects: a running request attends over its matched prefix's slots, so those must
not be evicted while it runs. `lock` adds one to a reference count on every node from the match
up to the root, `unlock` takes it away; only nodes with count 0 may be evicted. `locked_size`
(tokens on locked nodes) is what the engine may not count as free room.

Eviction frees whole leaves, least recently used first (every match and insert stamps the nodes
it walks with a clock): a leaf's removal may turn its parent into an evictable leaf in turn.
Once the pool is full every step evicts a few slots, so the unlocked leaves wait in a heap by stamp
instead of being collected from the whole tree at each call. A node goes in when it becomes an
unlocked leaf. When it comes out on top, it is dropped if it has since gained a child or a lock (it
goes in again once it is a free leaf again), and put back under its new stamp if it was used since.
What is left on top is the oldest leaf, found at a logarithm's cost.
"""

import heapq

import torch

from nano.kv_cache import SlotAllocator


class Node:
    def __init__(self, key: list[int], slots: torch.Tensor, parent: "Node | None", last_used: int = 0):
        self.key, self.slots, self.parent = key, slots, parent
        self.children: dict[int, Node] = {}  # by first token id
        self.lock_count, self.last_used = 0, last_used
        self.in_heap = False  # at most one entry each: the heap stays no larger than the tree


class RadixCache:
    def __init__(self, allocator: SlotAllocator):
        self.allocator = allocator
        self.root = Node([], torch.empty(0, dtype=torch.int32, device=allocator.free_slots.device), None)
        self.root.lock_count = 1  # never evicted
        self.size = 0  # tokens held
        self.locked_size = 0  # tokens on locked nodes
        self.clock = 0
        self.leaves: list[tuple[int, int, Node]] = []  # (stamp when offered, tie-break, node), a heap

    @property
    def evictable_size(self) -> int:
        return self.size - self.locked_size

    def match(self, tokens: list[int]) -> tuple[torch.Tensor, Node]:
        """The slots of the longest cached prefix of `tokens`, and the node where it ends."""
        path = [self.root, *self._walk(tokens)]  # the root's slots are empty
        return torch.cat([node.slots for node in path]), path[-1]

    def insert(self, tokens: list[int], slots: torch.Tensor) -> Node:
        """Cache `slots`, the K/V of `tokens` -> the node where they end. Where the tree already
        holds a prefix of `tokens`, the given slots for it are duplicates and go back to the
        allocator (those that are the tree's own, the request's matched prefix, stay)."""
        path, i, duplicates = self._walk(tokens), 0, []
        for node in path:
            mine = slots[i : i + len(node.key)]
            duplicates.append(mine[mine != node.slots])
            i += len(node.key)
        end = path[-1] if path else self.root
        if i < len(tokens):
            end = Node(tokens[i:], slots[i:], end, self.clock)
            end.parent.children[tokens[i]] = end
            self.size += len(end.key)
            self._offer(end)
        if duplicates:
            self.allocator.free(torch.cat(duplicates))
        return end

    def _walk(self, tokens: list[int]) -> list[Node]:
        """The nodes that spell the longest cached prefix of `tokens`, from the root down, stamped
        as just used; where the prefix ends inside a node, that node is split first."""
        self.clock += 1
        node, i, path = self.root, 0, []
        while i < len(tokens) and tokens[i] in node.children:
            child = node.children[tokens[i]]
            n = _common_length(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_used = self.clock
            path.append(child)
            node, i = child, i + n
        return path

    def _split(self, node: Node, n: int) -> Node:
        """Cut node after its first n tokens; -> the new upper part (the lower keeps the object,
        so a request holding it as its match still ends at the same token)."""
        upper = Node(node.key[:n], node.slots[:n], node.parent, node.last_used)
        upper.lock_count = node.lock_count
        upper.children[node.key[n]] = node
        node.parent.children[node.key[0]] = upper
        node.key, node.slots, node.parent = node.key[n:], node.slots[n:], upper
        return upper

    def lock(self, node: Node):
        while node is not self.root:
            if node.lock_count == 0:
                self.locked_size += len(node.key)
            node.lock_count += 1
            node = node.parent

    def unlock(self, node: Node):
        while node is not self.root:
            node.lock_count -= 1
            if node.lock_count == 0:
                self.locked_size -= len(node.key)
                self._offer(node)
            node = node.parent

    def _offer(self, node: Node):
        """Put node in the eviction heap if it is an unlocked leaf that is not there yet."""
        if not node.children and node.lock_count == 0 and not node.in_heap:
            heapq.heappush(self.leaves, (node.last_used, id(node), node))
            node.in_heap = True

    def evict(self, num_tokens: int):
        """Give at least num_tokens slots back to the allocator (fewer only if the unlocked
        part of the tree is smaller), least recently used leaves first."""
        freed = []
        while num_tokens > 0 and self.leaves:
            stamp, _, leaf = heapq.heappop(self.leaves)
            leaf.in_heap = False
            if leaf.children or leaf.lock_count:  # offered again once it is a free leaf again
                continue
            if stamp != leaf.last_used:  # used since it was offered: back in, under its stamp now
                self._offer(leaf)
                continue
            del leaf.parent.children[leaf.key[0]]
            freed.append(leaf.slots)
            num_tokens -= len(leaf.key)
            self.size -= len(leaf.key)
            self._offer(leaf.parent)  # the root is never offered: it is always locked
        if freed:
            self.allocator.free(torch.cat(freed))


def _common_length(key: list[int], tokens: list[int], start: int) -> int:
    """How many of key's tokens equal tokens[start:] from the start."""
    other = tokens[start : start + len(key)]
    return next((n for n, (a, b) in enumerate(zip(key, other)) if a != b), len(other))  # where they first differ
