#!/usr/bin/env python3
"""Train the embedded default pair: a small Qwen3 target and its DFLASH draft.

Everything is built from data present offline on every machine (the Python standard library's
own sources, including ``pydoc_data/topics.py``, the docs text), split into train / held-out
by file. Steps:

  (a) byte-level BPE tokenizer (``tokenizers``) with ChatML specials and a chat template, and a
      Qwen3-architecture target (``transformers.Qwen3ForCausalLM``) trained on code windows plus
      "docstring -> function" chat examples mined with ``ast``;
  (b) a DFLASH draft (``dflash.model.DFlashDraftModel``, the public format) trained against the
      frozen target: greedy target trajectories from training-split prompts, random anchors,
      blocks ``[anchor, MASK x (B-1)]`` attending non-causally inside the block over the target
      context features of all earlier positions, target embedding and lm_head frozen, CE of the
      target lm_head on draft outputs vs the target's own greedy continuation, decayed per position;
  (c) both saved in the public HF formats under ``python/sglite/assets/default_{model,draft}``.

Seeded (python, numpy, torch), deterministic algorithms, single-threaded by default so that a
rerun on the same machine/software reproduces the weights bit for bit (see docs/default_model.md).

Needs the ``test`` extra (``dflash==0.1.0``). Example:
    .venv/bin/python scripts/train_default_pair.py            # shipped defaults
    .venv/bin/python scripts/train_default_pair.py --out-dir "$(mktemp -d)" --target-steps 20 \
        --draft-steps 20 --num-trajectories 32                # quick smoke run
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

# Must be set before tokenizers spawns its thread pool: its parallel trainer is the one place
# where thread scheduling could leak into results.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
ASSETS_DIR = REPO_ROOT / "python" / "sglite" / "assets"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|MASK|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, MASK]

# ChatML as used by Qwen: every message is "<|im_start|>{role}\n{content}<|im_end|>\n".
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Directories of the stdlib that are not library code (tests, demos, installed third-party packages).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3", "__pycache__"}
)


@dataclass
class PairConfig:
    """Every knob of the run; the defaults are the shipped values."""

    out_dir: str = str(ASSETS_DIR)
    # "all" trains tokenizer + target + draft; "draft" reloads tokenizer + target from out_dir.
    stage: str = "all"
    seed: int = 0
    num_threads: int = 1
    heldout_percent: int = 5
    # >0: train on only the first N training files (quick smoke / reproducibility checks)
    max_train_files: int = 0
    # tokenizer
    vocab_size: int = 4096
    # target
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    context_length: int = 256
    target_steps: int = 500
    target_batch_size: int = 8
    target_lr: float = 3e-3
    chat_fraction: float = 0.25
    eval_windows: int = 64
    # draft
    draft_layers: int = 2
    block_size: int = 8
    num_trajectories: int = 512
    prompt_min_tokens: int = 16
    prompt_max_tokens: int = 128
    gen_tokens: int = 128
    gen_batch_size: int = 64
    draft_steps: int = 800
    draft_batch_size: int = 8
    blocks_per_seq: int = 16
    draft_lr: float = 3e-3
    loss_decay_gamma: float = 4.0


# --------------------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path) -> list[str]:
    """Relative paths of stdlib .py files in a fixed (sorted) order."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


def is_heldout(rel_path: str, heldout_percent: int) -> bool:
    """Held-out split by file: a stable hash of the relative path, so the split never depends on order."""
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < heldout_percent


def read_source(root: Path, rel_path: str) -> str:
    """File text; undecodable bytes (a few stdlib files are latin-1) become U+FFFD deterministically."""
    return (root / rel_path).read_text(encoding="utf-8", errors="replace")


@dataclass
class CorpusSplit:
    """Texts of the train and held-out files, in sorted path order."""

    train: list[tuple[str, str]]
    heldout: list[tuple[str, str]]


def load_corpus(heldout_percent: int) -> CorpusSplit:
    """Read the stdlib corpus and split it by file."""
    root = stdlib_root()
    train, heldout = [], []
    for rel in list_corpus_files(root):
        text = read_source(root, rel)
        (heldout if is_heldout(rel, heldout_percent) else train).append((rel, text))
    return CorpusSplit(train=train, heldout=heldout)


def chat_examples(source: str, max_chars: int = 1500) -> list[tuple[str, str]]:
    """(user, assistant) pairs: a function's docstring summary asks for the function's source."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines(keepends=True)
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        # Whole source lines of the def (ast.get_source_segment re-splits the file per call: too slow).
        segment = "".join(lines[node.lineno - 1 : node.end_lineno])
        if not doc or len(segment) > max_chars:
            continue
        summary = doc.strip().split("\n\n")[0].strip()
        if len(summary) < 10:
            continue
        request = f"Write a Python function `{node.name}`: {summary}"
        pairs.append((request, textwrap.dedent(segment)))
    return pairs


def render_chat(tokenizer, user: str, assistant: Optional[str]) -> str:
    """Chat-template text of one exchange (generation prompt only when assistant is None)."""
    messages = [{"role": "user", "content": user}]
    if assistant is None:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    messages.append({"role": "assistant", "content": assistant})
    return tokenizer.apply_chat_template(messages, tokenize=False)


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with ChatML specials, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    bpe.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, MASK],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 1 << 30
    return tokenizer


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Concatenate encoded texts, each followed by <|endoftext|>, into one int64 stream."""
    sep = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    ids: list[int] = []
    for text in tqdm(texts, desc="tokenize", leave=False):
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        ids.append(sep)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- target


def build_target(cfg: PairConfig, tokenizer):
    """A freshly initialised Qwen3ForCausalLM of the configured size."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.context_length,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        # Untied: every loader handles a separate lm_head.weight; a tied head is a second code path.
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        attn_implementation="sdpa",
        dtype="float32",
    )
    config.architectures = ["Qwen3ForCausalLM"]
    return Qwen3ForCausalLM(config)


def sample_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `length` tokens from a token stream."""
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_target(cfg: PairConfig, model, code: torch.Tensor, chat: torch.Tensor, gen: torch.Generator) -> list[float]:
    """Next-token training on a code/chat window mix; returns the loss curve."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.target_lr, betas=(0.9, 0.95), weight_decay=0.1)
    n_chat = round(cfg.target_batch_size * cfg.chat_fraction)
    n_code = cfg.target_batch_size - n_chat
    losses: list[float] = []
    bar = tqdm(range(cfg.target_steps), desc="target")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, cfg.target_steps, cfg.target_lr, warmup=min(50, cfg.target_steps // 10 + 1))
        parts = [sample_windows(code, n_code, cfg.context_length + 1, gen)]
        if n_chat:
            parts.append(sample_windows(chat, n_chat, cfg.context_length + 1, gen))
        window = torch.cat(parts)
        logits = model(input_ids=window[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.eval()
    return losses


@torch.no_grad()
def heldout_perplexity(model, stream: torch.Tensor, length: int, max_windows: int) -> tuple[float, int]:
    """Token perplexity over non-overlapping held-out windows; returns (ppl, tokens scored)."""
    n_windows = min(max_windows, (stream.numel() - 1) // length)
    total_nll, total_tokens = 0.0, 0
    for w in tqdm(range(n_windows), desc="heldout ppl", leave=False):
        chunk = stream[w * length : w * length + length + 1][None]
        logits = model(input_ids=chunk[:, :-1]).logits
        total_nll += F.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        total_tokens += length
    return math.exp(total_nll / total_tokens), total_tokens


# --------------------------------------------------------------------------- trajectories


def make_prompts(
    tokenizer, code: torch.Tensor, chat_pairs: list[tuple[str, str]], n: int, min_len: int, max_len: int, rng: random.Random
) -> list[list[int]]:
    """Half raw-code prefixes of random length, half chat generation prompts (docstring requests)."""
    prompts: list[list[int]] = []
    for i in range(n):
        if i % 2 == 0 or not chat_pairs:
            length = rng.randint(min_len, max_len)
            start = rng.randrange(0, code.numel() - length)
            prompts.append(code[start : start + length].tolist())
        else:
            user, _ = chat_pairs[rng.randrange(len(chat_pairs))]
            ids = tokenizer.encode(render_chat(tokenizer, user, None), add_special_tokens=False)
            prompts.append(ids[-max_len:])
    return prompts


@torch.no_grad()
def greedy_trajectories(model, prompts: list[list[int]], gen_tokens: int, batch_size: int, pad_id: int) -> list[list[int]]:
    """Target greedy continuations (a row ends at <|im_end|>, then pads), batched with left padding, in prompt order."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    out: dict[int, list[int]] = {}
    for b in tqdm(range(0, len(order), batch_size), desc="trajectories"):
        idx = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=gen_tokens,
            pad_token_id=pad_id,
        )
        for r, i in enumerate(idx):
            out[i] = prompts[i] + gen[r, width:].tolist()
    return [out[i] for i in range(len(prompts))]


@dataclass
class DraftData:
    """Trajectories with the frozen target's context features and the usable label range."""

    tokens: list[torch.Tensor]  # [L_i]
    features: list[torch.Tensor]  # [L_i, K*H]
    prompt_lens: list[int]
    valid_lens: list[int]  # labels at positions >= valid_len are ignored (after the first <|im_end|>)


@torch.no_grad()
def build_draft_data(model, trajectories, prompt_lens, layer_ids: list[int], eos_id: int, batch_size: int = 32) -> DraftData:
    """Run the frozen target once over every trajectory and keep the DFlash context features."""
    tokens, feats, plens, valid = [], [], [], []
    for b in tqdm(range(0, len(trajectories), batch_size), desc="target features"):
        chunk = trajectories[b : b + batch_size]
        width = max(len(t) for t in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, t in enumerate(chunk):
            ids[r, : len(t)] = torch.tensor(t)
        # Right padding under causal attention leaves every real position's states exact.
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        cat = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
        for r, t in enumerate(chunk):
            tok = torch.tensor(t)
            p = prompt_lens[b + r]
            eos = (tok[p:] == eos_id).nonzero()
            v = p + int(eos[0]) + 1 if eos.numel() else len(t)
            if v - p < 2:  # no anchor with a label after it
                continue
            tokens.append(tok)
            feats.append(cat[r, : len(t)].clone())
            plens.append(p)
            valid.append(v)
    return DraftData(tokens=tokens, features=feats, prompt_lens=plens, valid_lens=valid)


# --------------------------------------------------------------------------- draft


def draft_config(tc, *, num_layers: int, intermediate_size: int, block_size: int, mask_token_id: int, layer_ids: list[int]):
    """The public DFlash config of a draft as wide as the target config ``tc`` (Qwen3 layers, the target's rope)."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        max_position_embeddings=tc.max_position_embeddings,
        rope_parameters=dict(tc.rope_parameters),
        rms_norm_eps=tc.rms_norm_eps,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        dtype="float32",
    )
    config.architectures = ["DFlashDraftModel"]
    config.num_target_layers = tc.num_hidden_layers
    config.block_size = block_size
    config.dflash_config = {"block_size": block_size, "mask_token_id": mask_token_id, "target_layer_ids": layer_ids}
    return config


def build_draft(cfg: PairConfig, target, mask_token_id: int):
    """A fresh DFlashDraftModel with the target's width, saved in the public dflash format."""
    from dflash.model import DFlashDraftModel, build_target_layer_ids

    tc = target.config
    layer_ids = build_target_layer_ids(cfg.num_layers, cfg.draft_layers)
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(
            f"build_target_layer_ids({cfg.num_layers}, {cfg.draft_layers}) = {layer_ids} repeats a layer; "
            "use more target layers (>= 5 for 2 draft layers) or fewer draft layers"
        )
    config = draft_config(
        tc,
        num_layers=cfg.draft_layers,
        intermediate_size=tc.intermediate_size,
        block_size=cfg.block_size,
        mask_token_id=mask_token_id,
        layer_ids=layer_ids,
    )
    return DFlashDraftModel(config)


@dataclass
class DraftBatch:
    """One training batch of anchored blocks over padded trajectories."""

    target_hidden: torch.Tensor  # [N, T, K*H]
    block_ids: torch.Tensor  # [N, A*B]
    position_ids: torch.Tensor  # [N, T + A*B]
    attention_mask: torch.Tensor  # [N, 1, A*B, T + A*B] bool
    labels: torch.Tensor  # [N, A, B-1], -100 = ignore


def sample_draft_batch(data: DraftData, cfg: PairConfig, mask_id: int, gen: torch.Generator) -> DraftBatch:
    """Random trajectories, random anchors in the generated region, DFlash block inputs and mask."""
    B, A = cfg.block_size, cfg.blocks_per_seq
    rows = torch.randint(0, len(data.tokens), (cfg.draft_batch_size,), generator=gen).tolist()
    T = max(data.tokens[r].numel() for r in rows)
    N = len(rows)
    hidden = torch.zeros((N, T, data.features[0].shape[-1]))
    block_ids = torch.full((N, A * B), mask_id, dtype=torch.long)
    positions = torch.zeros((N, T + A * B), dtype=torch.long)
    positions[:, :T] = torch.arange(T)
    mask = torch.zeros((N, 1, A * B, T + A * B), dtype=torch.bool)
    labels = torch.full((N, A, B - 1), -100, dtype=torch.long)
    offs = torch.arange(B)
    for n, r in enumerate(rows):
        tok, L = data.tokens[r], data.tokens[r].numel()
        hidden[n, :L] = data.features[r]
        # Anchor a = the last committed token (the bonus); its own features are not known yet, so the
        # context is positions [0, a). At least one label (a+1) must be valid.
        lo, hi = data.prompt_lens[r], data.valid_lens[r] - 2
        anchors = torch.randint(lo, hi + 1, (A,), generator=gen)
        for k, a in enumerate(anchors.tolist()):
            q = slice(k * B, (k + 1) * B)
            block_ids[n, k * B] = tok[a]
            positions[n, T + k * B : T + (k + 1) * B] = a + offs
            mask[n, 0, q, :a] = True
            mask[n, 0, q, T + k * B : T + (k + 1) * B] = True
            for j in range(1, B):
                if a + j < data.valid_lens[r]:
                    labels[n, k, j - 1] = tok[a + j]
    return DraftBatch(hidden, block_ids, positions, mask, labels)


def train_draft(cfg: PairConfig, draft, target, data: DraftData, gen: torch.Generator) -> list[float]:
    """Distil the target's greedy continuation into the block draft; target weights stay frozen."""
    embed = target.get_input_embeddings().weight.detach()
    head = target.lm_head
    B = cfg.block_size
    weights = torch.exp(-torch.arange(B - 1, dtype=torch.float32) / cfg.loss_decay_gamma)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.draft_lr, betas=(0.9, 0.95), weight_decay=0.01)
    draft.train()
    losses: list[float] = []
    tau_hist: list[float] = []
    bar = tqdm(range(cfg.draft_steps), desc="draft")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, cfg.draft_steps, cfg.draft_lr, warmup=min(100, cfg.draft_steps // 10 + 1))
        batch = sample_draft_batch(data, cfg, draft.mask_token_id, gen)
        out = draft(
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
            noise_embedding=F.embedding(batch.block_ids, embed),
            target_hidden=batch.target_hidden,
        )
        N, A = batch.labels.shape[:2]
        hidden = out.view(N, A, B, -1)[:, :, 1:]
        logits = head(hidden)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1), reduction="none", ignore_index=-100)
        valid = (batch.labels != -100).float()
        w = weights.view(1, 1, -1) * valid
        loss = (nll.view_as(w) * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        with torch.no_grad():
            # Expected acceptance length of these blocks under greedy verification: 1 + accepted prefix.
            hit = (logits.argmax(-1) == batch.labels) | (batch.labels == -100)
            tau_hist.append(1.0 + hit.long().cumprod(-1).sum(-1).float().mean().item())
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}", tau=f"{np.mean(tau_hist[-20:]):.2f}")
    draft.eval()
    return losses


# --------------------------------------------------------------------------- main


def seed_everything(seed: int, num_threads: int) -> None:
    """Seed every RNG and pin the thread count; deterministic kernels where torch has them."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def parse_config_args(cls, argv: Optional[list[str]], description: Optional[str]):
    """An instance of the config dataclass ``cls`` whose fields are CLI flags (`--target-steps 700`, ...)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(cls):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, dest=f.name)
    return cls(**vars(parser.parse_args(argv)))


def parse_args(argv: Optional[list[str]] = None) -> PairConfig:
    """CLI flags mirror PairConfig fields."""
    return parse_config_args(PairConfig, argv, __doc__)


def main(argv: Optional[list[str]] = None) -> None:
    """Train tokenizer, target and draft; save them; print a JSON summary."""
    cfg = parse_args(argv)
    seed_everything(cfg.seed, cfg.num_threads)
    t0 = time.perf_counter()
    out = Path(cfg.out_dir)
    model_dir, draft_dir = out / "default_model", out / "default_draft"
    model_dir.mkdir(parents=True, exist_ok=True)
    draft_dir.mkdir(parents=True, exist_ok=True)

    corpus = load_corpus(cfg.heldout_percent)
    if cfg.max_train_files > 0:
        corpus = CorpusSplit(train=corpus.train[: cfg.max_train_files], heldout=corpus.heldout)
    train_texts = [t for _, t in corpus.train]
    print(f"corpus {stdlib_root()}: {len(corpus.train)} train files, {len(corpus.heldout)} held-out files", flush=True)

    if cfg.stage == "all":
        tokenizer = train_tokenizer(train_texts, cfg.vocab_size)
        tokenizer.save_pretrained(model_dir)
    elif cfg.stage == "draft":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    else:
        raise ValueError(f"--stage must be 'all' or 'draft', got {cfg.stage!r}")
    pairs = [p for _, t in corpus.train for p in chat_examples(t)]
    code = encode_stream(tokenizer, train_texts)
    chat = encode_stream(tokenizer, [render_chat(tokenizer, u, a) for u, a in pairs])
    heldout_code = encode_stream(tokenizer, [t for _, t in corpus.heldout])
    print(f"tokens: code {code.numel()}, chat {chat.numel()} ({len(pairs)} pairs), held-out {heldout_code.numel()}", flush=True)
    t_tok = time.perf_counter()

    gen = torch.Generator().manual_seed(cfg.seed)
    target_losses: list[float] = []
    if cfg.stage == "all":
        torch.manual_seed(cfg.seed)
        target = build_target(cfg, tokenizer)
        target_losses = train_target(cfg, target, code, chat, gen)
        target.save_pretrained(model_dir, safe_serialization=True)
    else:
        from transformers import Qwen3ForCausalLM

        target = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ppl, ppl_tokens = heldout_perplexity(target, heldout_code, cfg.context_length, cfg.eval_windows)
    print(f"target: {sum(p.numel() for p in target.parameters())} params, held-out ppl {ppl:.3f} on {ppl_tokens} tokens", flush=True)
    t_target = time.perf_counter()

    rng = random.Random(cfg.seed)
    prompts = make_prompts(tokenizer, code, pairs, cfg.num_trajectories, cfg.prompt_min_tokens, cfg.prompt_max_tokens, rng)
    trajectories = greedy_trajectories(target, prompts, cfg.gen_tokens, cfg.gen_batch_size, tokenizer.pad_token_id)
    t_traj = time.perf_counter()

    mask_id = tokenizer.convert_tokens_to_ids(MASK)
    torch.manual_seed(cfg.seed + 1)
    draft = build_draft(cfg, target, mask_id)
    data = build_draft_data(target, trajectories, [len(p) for p in prompts], draft.target_layer_ids, tokenizer.eos_token_id)
    for p in target.parameters():
        p.requires_grad_(False)
    print(f"draft data: {len(data.tokens)} trajectories, {sum(v - p for v, p in zip(data.valid_lens, data.prompt_lens))} labelled positions", flush=True)
    # Own stream per stage, so `--stage draft` on the saved target reproduces the draft of `--stage all`.
    draft_gen = torch.Generator().manual_seed(cfg.seed + 1)
    draft_losses = train_draft(cfg, draft, target, data, draft_gen)
    draft.save_pretrained(draft_dir, safe_serialization=True)
    t_draft = time.perf_counter()

    summary = {
        "config": dataclasses.asdict(cfg),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "stdlib": str(stdlib_root()),
        "train_files": len(corpus.train),
        "heldout_files": len(corpus.heldout),
        "train_code_tokens": code.numel(),
        "train_chat_tokens": chat.numel(),
        "heldout_ppl": ppl,
        "heldout_ppl_tokens": ppl_tokens,
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "target_final_loss": float(np.mean(target_losses[-50:])) if target_losses else None,
        "draft_final_loss": float(np.mean(draft_losses[-50:])),
        "seconds": {
            "tokenizer": round(t_tok - t0, 1),
            "target": round(t_target - t_tok, 1),
            "trajectories": round(t_traj - t_target, 1),
            "draft": round(t_draft - t_traj, 1),
            "total": round(t_draft - t0, 1),
        },
        "sha256": {
            str(p.relative_to(out)): file_sha256(p)
            for d in (model_dir, draft_dir)
            for p in sorted(d.iterdir())
            if p.is_file()
        },
    }
    print(json.dumps(summary, indent=2), flush=True)


if __name__ == "__main__":
    main()
