"""Tiny DFLASH / DSPARK drafts for tests: random checkpoints in the public format, a few-second trainer,
and a re-run of the `dflash` package's greedy loop that reports per-step acceptance lengths.

The `dflash` package (the DFlash authors' reference) is a test-only dependency; it is imported
inside the functions that need it so importing this module never requires it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

TINY_VOCAB = 512
TINY_MASK_TOKEN_ID = TINY_VOCAB - 1


@dataclass(frozen=True)
class TinyDraftSpec:
    """Shape of a tiny block-diffusion draft."""

    num_layers: int = 2
    block_size: int = 4
    mask_token_id: int = TINY_MASK_TOKEN_ID
    target_layer_ids: tuple[int, ...] = (1, 2)


@dataclass
class TrainedDraft:
    """A draft trained against a target, and the prompts it was trained on."""

    draft_dir: str
    prompts: list[list[int]]
    final_loss: float


def build_tiny_target(
    path: str, *, seed: int = 0, num_layers: int = 4, vocab_size: int = TINY_VOCAB, with_tokenizer: bool = False,
    arch: str = "qwen3",
) -> str:
    """Save a tiny random fp32 target of ``arch`` (``tiny_models``: hidden 64, wide init; Qwen3 by default) with no EOS.

    ``with_tokenizer`` adds the tiny 512-token BPE tokenizer (for servers and stop strings; ~10 s).
    """
    from sglite.testing.tiny_models import build_tiny_model

    return build_tiny_model(
        path, arch, seed=seed, with_tokenizer=with_tokenizer, num_hidden_layers=num_layers,
        vocab_size=vocab_size, eos_token_id=None,
    )


def _draft_config(target_dir: str, spec: TinyDraftSpec):
    from transformers import AutoConfig, Qwen3Config

    target_cfg = AutoConfig.from_pretrained(target_dir)
    return Qwen3Config(
        vocab_size=target_cfg.vocab_size,
        hidden_size=target_cfg.hidden_size,
        intermediate_size=target_cfg.intermediate_size,
        num_hidden_layers=spec.num_layers,
        # The draft's own attention (GQA 4/2 of 16 dims) whatever the target's: an MLA or MoE target's draft
        # is a dense Qwen3-style model, priced from this geometry.
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=target_cfg.max_position_embeddings,
        rope_theta=getattr(target_cfg, "rope_theta", None) or target_cfg.rope_parameters["rope_theta"],
        initializer_range=0.3,
        num_target_layers=target_cfg.num_hidden_layers,
        block_size=spec.block_size,
        dflash_config={
            "block_size": spec.block_size,
            "mask_token_id": spec.mask_token_id,
            "target_layer_ids": list(spec.target_layer_ids),
        },
        architectures=["DFlashDraftModel"],
    )


def build_tiny_dflash_draft(path: str, target_dir: str, *, seed: int = 1, spec: TinyDraftSpec = TinyDraftSpec()) -> str:
    """Save a random `dflash.model.DFlashDraftModel` matching the target's dims (public checkpoint format)."""
    from dflash.model import DFlashDraftModel

    torch.manual_seed(seed)
    draft = DFlashDraftModel(_draft_config(target_dir, spec)).to(torch.float32).eval()
    draft.config.architectures = ["DFlashDraftModel"]
    draft.save_pretrained(path)
    return path


def load_reference_pair(target_dir: str, draft_dir: str):
    """Load the target (transformers) and the draft (`dflash` package) in fp32 with sdpa attention."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3ForCausalLM

    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return target, draft


def random_prompts(num: int, *, seed: int, min_len: int = 4, max_len: int = 12, vocab_size: int = TINY_VOCAB) -> list[list[int]]:
    """Random prompts of token ids below the mask id, lengths in [min_len, max_len]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        out.append(torch.randint(0, vocab_size - 1, (n,), generator=g).tolist())
    return out


@torch.no_grad()
def _greedy_trajectories(target, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
        out.append(gen[0].tolist())
    return out


def train_tiny_draft(
    out_dir: str,
    target_dir: str,
    *,
    steps: int = 300,
    seed: int = 0,
    num_prompts: int = 16,
    prompt_len: int = 10,
    new_tokens: int = 48,
    spec: TinyDraftSpec = TinyDraftSpec(),
    lr: float = 3e-3,
) -> TrainedDraft:
    """Overfit a draft on the target's greedy continuations of a few prompts, so acceptance is high but partial.

    Each step picks one anchor a for a batch of trajectories s: block ``[s[a], MASK x (B-1)]``,
    context = target features of ``s[:a]``, loss = cross-entropy of the target's lm_head over the
    block rows 1..B-1 against ``s[a+1 : a+B]`` (the DFlash training target, without decay).
    """
    from dflash.model import DFlashDraftModel, extract_context_feature

    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM

    # Any served family (MoE targets included): eager experts run everywhere.
    target = AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=torch.float32, attn_implementation="sdpa", experts_implementation="eager"
    ).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    draft = DFlashDraftModel(_draft_config(target_dir, spec)).to(torch.float32).train()
    prompts = random_prompts(num_prompts, seed=seed + 1000, min_len=prompt_len, max_len=prompt_len)
    seqs = torch.tensor(_greedy_trajectories(target, prompts, new_tokens))  # [N, T]
    with torch.no_grad():
        out = target(seqs, output_hidden_states=True)
        feats = extract_context_feature(out.hidden_states, draft.target_layer_ids)  # [N, T, K*H]
        embed = target.get_input_embeddings().weight
    block = spec.block_size
    total = seqs.shape[1]
    opt = torch.optim.AdamW(draft.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    loss_val = float("nan")
    for _ in range(steps):
        a = int(torch.randint(1, total - block + 1, (1,), generator=g))
        noise_ids = torch.full((seqs.shape[0], block), spec.mask_token_id, dtype=torch.long)
        noise_ids[:, 0] = seqs[:, a]
        hidden = draft(
            position_ids=torch.arange(a + block)[None].expand(seqs.shape[0], -1),
            noise_embedding=torch.nn.functional.embedding(noise_ids, embed),
            target_hidden=feats[:, :a],
        )
        logits = target.lm_head(hidden[:, 1:])
        labels = seqs[:, a + 1 : a + block]
        valid = labels.shape[1]
        loss = torch.nn.functional.cross_entropy(logits[:, :valid].reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_val = float(loss.detach())
    draft.eval()
    draft.config.architectures = ["DFlashDraftModel"]
    draft.save_pretrained(out_dir)
    return TrainedDraft(draft_dir=out_dir, prompts=prompts, final_loss=loss_val)


def build_tiny_dspark_draft(
    path: str,
    dflash_draft_dir: str,
    *,
    markov_rank: int = 8,
    markov_scale: float = 1.0,
    seed: int = 2,
    markov_head_type: str = "vanilla",
    enable_confidence_head: bool = False,
    confidence_head_with_markov: bool = False,
    sample_from_anchor: bool = True,
    with_embeddings: bool = False,
    target_dir: Optional[str] = None,
) -> str:
    """Save a DSPARK draft in the released layout: the DFLASH draft's weights + Markov / confidence heads.

    Config fields sit at the top level (``mask_token_id``, ``target_layer_ids``, ``block_size``,
    ``markov_rank``, ``markov_head_type``, ``sample_from_anchor``, ...). Weights add SGLang 0.5.23's
    names: ``markov_head.markov_w1.weight [V, r]``, ``markov_head.markov_w2.weight [V, r]``, the
    gated head's ``markov_head.gate_proj`` / the rnn head's ``markov_head.joint_proj`` (with biases)
    and ``confidence_head.proj.{weight,bias}``. ``markov_scale=0`` zeroes the Markov bias.
    ``with_embeddings`` also stores ``embed_tokens`` / ``lm_head`` copies of ``target_dir``'s, as the
    released checkpoints do.
    """
    from safetensors.torch import load_file, save_file

    with open(os.path.join(dflash_draft_dir, "config.json")) as f:
        cfg = json.load(f)
    nested = cfg.pop("dflash_config", {})
    cfg.update(
        architectures=["DSparkDraftModel"],
        mask_token_id=nested["mask_token_id"],
        target_layer_ids=nested["target_layer_ids"],
        block_size=nested.get("block_size", cfg.get("block_size", 16)),
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        enable_confidence_head=enable_confidence_head,
        confidence_head_with_markov=confidence_head_with_markov,
        sample_from_anchor=sample_from_anchor,
        tie_word_embeddings=False,
    )
    cfg.pop("auto_map", None)
    weights = load_file(os.path.join(dflash_draft_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    vocab, hidden, r = cfg["vocab_size"], cfg["hidden_size"], markov_rank

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    weights["markov_head.markov_w1.weight"] = rand(vocab, r, scale=markov_scale)
    weights["markov_head.markov_w2.weight"] = rand(vocab, r, scale=markov_scale)
    if markov_head_type == "gated":
        weights["markov_head.gate_proj.weight"] = rand(r, hidden + r, scale=0.3)
        weights["markov_head.gate_proj.bias"] = rand(r, scale=0.3)
    elif markov_head_type == "rnn":
        weights["markov_head.joint_proj.weight"] = rand(3 * r, 2 * r + hidden, scale=0.3)
        weights["markov_head.joint_proj.bias"] = rand(3 * r, scale=0.3)
    if enable_confidence_head:
        width = hidden + (r if confidence_head_with_markov else 0)
        weights["confidence_head.proj.weight"] = rand(1, width, scale=0.1)
        weights["confidence_head.proj.bias"] = rand(1, scale=0.5)
    if with_embeddings:
        target = load_file(os.path.join(target_dir, "model.safetensors"))
        weights["embed_tokens.weight"] = target["model.embed_tokens.weight"]
        weights["lm_head.weight"] = target.get("lm_head.weight", target["model.embed_tokens.weight"])
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path


@torch.no_grad()
def _check_margins(logits: torch.Tensor, min_margin: float, what: str) -> None:
    """Each row's top-1 logit leads its runner-up by >= min_margin (no-op for min_margin <= 0)."""
    if min_margin <= 0 or logits.shape[0] == 0:
        return
    top2 = logits.float().topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    if float(gaps.min()) < min_margin:
        pos = int(gaps.argmin())
        raise AssertionError(
            f"{what}, block position {pos}: top-1/top-2 logit margin {float(gaps[pos]):.3g} < {min_margin:g}, "
            "a near-tie that CPU rounding can flip; choose another prompt or seed"
        )


def reference_block_generate(
    draft,
    target,
    input_ids: list[int],
    max_new_tokens: int,
    stop_token_ids: Optional[list[int]] = None,
    block_size: Optional[int] = None,
    min_margin: float = 0.0,
) -> tuple[list[int], list[int]]:
    """Greedy `dflash_generate` loop re-run with the package's classes, always verifying full blocks.

    `dflash.model.dflash_generate` shrinks the last block to the remaining budget and does not
    return per-step lengths on CPU; this re-run keeps every block at B (as a serving engine does,
    truncating output to the budget) and returns (generated ids, tokens committed per verify step).
    Tests check it against `dflash_generate` itself.

    With ``min_margin`` > 0 every argmax that decides the output or an acceptance length (the
    first token, each step's committed target tokens, its accepted drafts and first rejected draft)
    must lead its runner-up logit by that much, or an AssertionError names the step: below it, another
    implementation's (or CPU's) rounding may pick the other token (see sglite.testing.greedy_margin).
    """
    from dflash.model import _crop_to, _draft_value, _make_cache, _output_head, _raw_input_embeddings, extract_context_feature

    block = draft.block_size if block_size is None else block_size
    embed_scale = float(_draft_value(draft.config, "input_embedding_scale", 1.0))
    n_in = len(input_ids)
    ids = torch.tensor([input_ids])
    tcache, dcache = _make_cache(target.config), _make_cache(draft.config)
    out = target(ids, position_ids=torch.arange(n_in)[None], past_key_values=tcache, use_cache=True, output_hidden_states=True)
    tokens = list(input_ids) + [int(out.logits[0, -1].argmax())]
    _check_margins(out.logits[0, -1:], min_margin, "first token (target)")
    hidden = extract_context_feature(out.hidden_states, draft.target_layer_ids)
    stops = set(stop_token_ids or [])
    lengths: list[int] = []
    start = n_in  # index of the last committed token (the next block's anchor)
    stopped = tokens[-1] in stops
    while len(tokens) - n_in < max_new_tokens and not stopped:
        blk = torch.full((1, block), draft.mask_token_id, dtype=torch.long)
        blk[0, 0] = tokens[start]
        ctx = hidden.shape[1]
        dh = draft(
            target_hidden=hidden,
            noise_embedding=_raw_input_embeddings(target, blk, embed_scale),
            position_ids=torch.arange(start - ctx, start + block)[None],
            past_key_values=dcache,
            use_cache=True,
        )[:, 1:]
        _crop_to(dcache, start)
        draft_logits = draft.compute_logits(dh, _output_head(target))[0]
        blk[0, 1:] = draft_logits.argmax(-1)
        vo = target(blk, position_ids=torch.arange(start, start + block)[None], past_key_values=tcache, use_cache=True, output_hidden_states=True)
        post = vo.logits[0].argmax(-1)
        acc = int((blk[0, 1:] == post[:-1]).to(torch.int64).cumprod(0).sum())
        _check_margins(draft_logits[: acc + 1], min_margin, f"verify step {len(lengths)} (draft)")
        _check_margins(vo.logits[0, : acc + 1], min_margin, f"verify step {len(lengths)} (target)")
        new = blk[0, 1 : 1 + acc].tolist() + [int(post[acc])]
        new = new[: max_new_tokens - (len(tokens) - n_in)]
        for i, t in enumerate(new):
            if t in stops:
                new = new[: i + 1]
                stopped = True
                break
        tokens += new
        lengths.append(len(new))
        start += len(new)
        _crop_to(tcache, start)
        hidden = extract_context_feature(vo.hidden_states, draft.target_layer_ids)[:, : len(new)]
    return tokens[n_in:], lengths


def load_sglite_draft(draft_dir: str, hf_target):
    """Load a DFLASH/DSPARK draft with sglite's loader (fp32, CPU) and attach the HF target's embedding and head.

    Needs a published one-rank parallel runtime (the layers resolve the TP group).
    """
    from sglite.srt.configs.model_config import ModelConfig
    from sglite.srt.layers.logits_processor import LogitsProcessor
    from sglite.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from sglite.srt.model_loader.loader import load_model

    cfg = ModelConfig.from_path(draft_dir)
    model = load_model(cfg, draft_dir, torch.device("cpu"), torch.float32, show_progress=False)
    vocab, hidden = hf_target.config.vocab_size, hf_target.config.hidden_size
    embed = VocabParallelEmbedding(vocab, hidden, params_dtype=torch.float32)
    embed.weight_loader(embed.weight, hf_target.get_input_embeddings().weight.detach())
    head = ParallelLMHead(vocab, hidden, params_dtype=torch.float32)
    head.weight_loader(head.weight, hf_target.lm_head.weight.detach())
    model.attach_target_head(embed, head, LogitsProcessor(vocab))
    return model


def draft_block_forward(model, contexts: list, anchors: list[int], *, pool_size: int = 256, backend: str = "torch_native"):
    """Run one DRAFT_BLOCK forward of ``model`` over per-request context features; returns (output, forward batch).

    ``contexts[i]`` is a ``[n_i, K*H]`` feature tensor written as context K/V at positions ``0..n_i-1``.
    ``backend`` is an ``--attention-backend`` name (triton on CPU needs TRITON_INTERPRET=1).
    """
    from types import SimpleNamespace

    from sglite.srt.layers.attention.registry import create_attention_backend
    from sglite.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglite.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglite.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch

    cfg = model.config
    block = model.block_size
    allocator = PagedTokenToKVPoolAllocator(pool_size, 1, "cpu")
    req_pool = ReqToTokenPool(len(contexts) + 1, max(c.shape[0] for c in contexts) + block + 1, "cpu")
    pool = MHATokenToKVPool(
        pool_size, 1, torch.float32, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim, cfg.num_hidden_layers, "cpu"
    )
    rows = req_pool.alloc(len(contexts))
    for row, feats in zip(rows, contexts):
        n = feats.shape[0]
        slots = allocator.alloc(n)
        req_pool.req_to_token[row, :n] = slots.to(req_pool.req_to_token.dtype)
        model.write_context_kv(feats, torch.arange(n), slots, pool)
    attn = create_attention_backend(backend, SimpleNamespace(device=torch.device("cpu")))
    reqs = [(row, c.shape[0], [a] + [model.mask_token_id] * (block - 1)) for row, c, a in zip(rows, contexts, anchors)]
    fb = build_forward_batch(
        ForwardMode.DRAFT_BLOCK, reqs, req_to_token_pool=req_pool, token_to_kv_pool=pool, allocator=allocator, attn_backend=attn
    )
    attn.init_forward_metadata(fb)
    return model(fb.input_ids, fb.positions, fb), fb


def assert_block_equals_reference(out, ref, hf_target, contexts: list, anchors: list[int], *, logits_atol: float) -> None:
    """Each request's block of ``out`` (hidden states, logits) equals the ``dflash`` package's draft ``ref``."""
    block = len(out.hidden_states) // len(contexts)
    embed = hf_target.get_input_embeddings().weight
    for i, (f, a) in enumerate(zip(contexts, anchors)):
        ids = torch.tensor([[a] + [ref.mask_token_id] * (block - 1)])
        ref_h = ref(
            position_ids=torch.arange(f.shape[0] + block)[None],
            noise_embedding=torch.nn.functional.embedding(ids, embed),
            target_hidden=f[None],
        )[0]
        rows = slice(i * block, (i + 1) * block)
        torch.testing.assert_close(out.hidden_states[rows], ref_h, atol=1e-4, rtol=0)
        ref_logits = ref.compute_logits(ref_h, hf_target.lm_head)
        torch.testing.assert_close(out.next_token_logits[rows], ref_logits, atol=logits_atol, rtol=0)
