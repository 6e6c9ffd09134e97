"""A model-free worker for scheduler tests: a 'model' whose next token is a hash of the sequence it
reads back through ``req_to_token`` and a fake KV pool.

Each forward writes (token, position) into the fake KV at ``out_cache_loc`` and computes every next
token from the keys it reads at ``req_to_token[row, :P+i+1]``, checking their positions. So a wrong
slot mapping, a prefix-cache hit on the wrong slots, a slot freed while still in use or a stale
rejected-draft slot changes the output, and the test's reference (``reference_generate``, the same
hash over a plain Python list) catches it. ``block_size > 1`` simulates exact speculative decoding:
the draft proposes a random number of correct tokens followed by wrong ones, the verify accepts the
longest correct prefix plus one bonus token, and rejected positions keep garbage K/V.
"""

from __future__ import annotations

import random
from typing import Any, Optional, Sequence

import torch

from sglite.srt.managers.base_model_worker import BaseModelWorker
from sglite.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglite.srt.mem_cache.memory_pool import ReqToTokenPool
from sglite.srt.speculative.dflash_worker import DFlashStepStats

_HASH_MOD = 1_000_003


def next_token(seq: Sequence[int], vocab_size: int) -> int:
    """The fake model's greedy next token after ``seq`` (a polynomial hash)."""
    h = 0
    for t in seq:
        h = (h * 31 + int(t) + 1) % _HASH_MOD
    return h % vocab_size


def reference_generate(
    prompt: Sequence[int],
    max_new_tokens: int,
    vocab_size: int,
    eos_token_ids: Sequence[int] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
) -> list[int]:
    """Plain greedy loop of the fake model with the finish rules (length, EOS, stop ids)."""
    seq, out = list(prompt), []
    while len(out) < max_new_tokens:
        tok = next_token(seq, vocab_size)
        seq.append(tok)
        out.append(tok)
        if tok in stop_token_ids or (not ignore_eos and tok in eos_token_ids):
            break
    return out


class FakeModelWorker(BaseModelWorker):
    """A BaseModelWorker over a fake KV pool (CPU, no model, no runners)."""

    def __init__(
        self,
        *,
        max_total_num_tokens: int = 512,
        page_size: int = 1,
        max_running_requests: int = 16,
        context_len: int = 256,
        vocab_size: int = 64,
        block_size: int = 1,
        seed: int = 0,
    ) -> None:
        self.max_total_num_tokens = max_total_num_tokens
        self.max_running_requests = max_running_requests
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.num_decode_tokens_per_req = block_size
        self.is_speculative = block_size > 1
        self.num_proposed_drafts = block_size - 1  # the DFLASH convention: B-1 drafts, B verified
        self.last_step: Optional[DFlashStepStats] = None
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, context_len + block_size, "cpu", torch.int64)
        self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(max_total_num_tokens, page_size, "cpu")
        n_slots = max_total_num_tokens + page_size
        self.kv_token = torch.full((n_slots,), -1, dtype=torch.int64)
        self.kv_pos = torch.full((n_slots,), -1, dtype=torch.int64)
        self.rng = random.Random(seed)
        self.batch_sizes: list[tuple[str, int]] = []  # (kind, batch size) per forward, for tests

    def memory_plan(self) -> dict[str, Any]:
        """The fake plan: just the pool size."""
        return {"max_total_num_tokens": self.max_total_num_tokens, "page_size": self.token_to_kv_pool_allocator.page_size}

    # ------------------------------------------------------------------ the fake model
    def _write(self, slots: torch.Tensor, tokens: Sequence[int], start_pos: int) -> None:
        slots = slots.to(torch.int64)
        self.kv_token[slots] = torch.tensor(list(tokens), dtype=torch.int64)
        self.kv_pos[slots] = torch.arange(start_pos, start_pos + len(tokens), dtype=torch.int64)

    def _read(self, row: int, length: int) -> list[int]:
        slots = self.req_to_token_pool.req_to_token[row, :length].to(torch.int64)
        pos = self.kv_pos[slots]
        if not torch.equal(pos, torch.arange(length, dtype=torch.int64)):
            raise AssertionError(f"row {row}: KV positions {pos.tolist()} are not 0..{length - 1}")
        return self.kv_token[slots].tolist()

    def forward_prefill(self, batch: Any) -> list[list[int]]:
        """Write the chunk's K/V, return the next token after each request's last new token."""
        self.batch_sizes.append(("prefill", batch.batch_size))
        out, offset = [], 0
        for i, req in enumerate(batch.reqs):
            p, n = batch.prefix_lens[i], batch.extend_lens[i]
            toks = batch.input_ids[offset : offset + n]
            offset += n
            self._write(batch.slots_of(i), toks, p)
            out.append([next_token(self._read(req.req_pool_idx, p + n), self.vocab_size)])
        return out

    def forward_decode(self, batch: Any) -> list[list[int]]:
        """One decode (block_size 1) or one draft+verify step (block_size B)."""
        self.batch_sizes.append(("decode", batch.batch_size))
        b = self.num_decode_tokens_per_req
        out = []
        for i, req in enumerate(batch.reqs):
            p, row, bonus = batch.prefix_lens[i], req.req_pool_idx, batch.input_ids[i]
            slots = batch.slots_of(i)
            if b == 1:
                self._write(slots, [bonus], p)
                out.append([next_token(self._read(row, p + 1), self.vocab_size)])
                continue
            # Draft: a random number of correct tokens, then wrong ones (the truth comes from the KV).
            truth_seq = self._read(row, p) + [bonus]
            n_good = self.rng.randint(0, b - 1)
            drafts: list[int] = []
            for j in range(b - 1):
                t = next_token(truth_seq + drafts, self.vocab_size)
                drafts.append(t if j < n_good else (t + 1) % self.vocab_size)
            # Verify: write K/V for bonus + drafts, compute the target token after each position.
            self._write(slots, [bonus] + drafts, p)
            accepted: list[int] = []
            for j in range(b):
                target = next_token(self._read(row, p + j + 1), self.vocab_size)
                accepted.append(target)
                if j == b - 1 or drafts[j] != target:
                    break
            out.append(accepted)
        if b > 1:
            self.last_step = DFlashStepStats(
                accept_lens=[len(a) - 1 for a in out], draft_ids=[], verified_drafts=self.num_proposed_drafts
            )
        return out


def tiny_char_tokenizer(vocab_size: int) -> Any:
    """A tokenizer whose token i decodes to one letter (for stop-string tests)."""

    class _CharTokenizer:
        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(ord("a") + int(i) % 26) for i in ids)

    return _CharTokenizer()


def reference_generate_with_stop_str(
    prompt: Sequence[int], max_new_tokens: int, vocab_size: int, stop: Sequence[str], tokenizer: Any
) -> Optional[list[int]]:
    """Greedy loop that also stops when a stop string appears in the decoded output."""
    seq, out = list(prompt), []
    while len(out) < max_new_tokens:
        tok = next_token(seq, vocab_size)
        seq.append(tok)
        out.append(tok)
        text = tokenizer.decode(out)
        if any(s in text for s in stop):
            break
    return out
