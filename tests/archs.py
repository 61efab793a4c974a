"""Tiny random-init configs of every architecture in the families table (shardtune/families.py),
in one place: a few hundred thousand parameters each, built in well under a second, no hub.
Values that default to a no-op (Granite's logits_scaling=1) are set so that what the table
claims about the family can be seen in the numbers."""

from __future__ import annotations

import contextlib

COMMON = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 128, "vocab_size": 300, "bos_token_id": 0,
          "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": False}
_GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128}
# every layer a mixture of experts, with the router's load-balancing loss on
_MOE = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "output_router_logits": True, "router_aux_loss_coef": 0.02}
ARCHS = {
    "gpt2": _GPT2,
    "gpt_bigcode": _GPT2,
    "gpt_neo": {"num_layers": 2, "attention_types": [[["global", "local"], 1]], "window_size": 16},
    "gptj": {**_GPT2, "rotary_dim": 8},
    "codegen": {**_GPT2, "n_ctx": 128, "rotary_dim": 8},
    "bloom": {"n_layer": 2, "n_head": 4},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "falcon": {},
    "gpt_neox": {},
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "final_logit_softcapping": 0.5},
    "gemma3_text": {"head_dim": 16, "final_logit_softcapping": 0.5},
    "stablelm": {},
    "olmo2": {},
    "granite": {"logits_scaling": 2.0},
    "cohere": {"logit_scale": 0.5},
    "smollm3": {},
    "starcoder2": {},
    "glm4": {"head_dim": 16},
    "phi": {},
    "phi3": {},
    "mixtral": _MOE,
    "qwen2_moe": {**_MOE, "shared_expert_intermediate_size": 32},
    "qwen3_moe": {**_MOE, "head_dim": 16},
    "olmoe": _MOE,
    "phimoe": _MOE,
    "granitemoe": {**_MOE, "logits_scaling": 2.0},
    "gpt_oss": {**_MOE, "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    # multi-head latent attention wants as many K/V heads as query heads; layer 0 dense, layer 1 MoE
    "deepseek_v3": {**_MOE, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1},
}


def arch_config(model_type: str) -> dict:
    """The tiny config of `model_type` as a `model.config` dict (with its model_type)."""
    return {"model_type": model_type, **COMMON, **ARCHS[model_type]}


def hf_config(model_type: str, **extra):
    from transformers import AutoConfig

    cfg = {**arch_config(model_type), **extra}
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


# Any other architecture: its config class's defaults, every size field shrunk by its name (the
# names transformers' configs use for one quantity), in sub-configs (text_config, ...) too.
_TINY_FIELDS = {
    2: ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers", "encoder_layers",
        "num_decoder_layers", "num_encoder_layers", "num_experts_per_tok", "moe_topk", "top_k", "moe_k"),
    64: ("hidden_size", "n_embd", "d_model", "embed_dim", "emb_dim", "word_embed_proj_dim", "dim", "embedding_size"),
    128: ("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "d_ff",
          "ffn_hidden_size", "max_position_embeddings", "n_positions", "n_ctx"),
    4: ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
        "encoder_attention_heads", "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    16: ("head_dim", "kv_lora_rank", "lora_rank", "v_head_dim", "attention_head_dim"),
    32: ("moe_intermediate_size", "shared_expert_intermediate_size", "q_lora_rank", "expert_ffn_hidden_size"),
    8: ("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim"),
    1: ("n_shared_experts", "num_shared_experts", "n_group", "n_groups", "topk_group", "first_k_dense_replace"),
}
TINY_FIELDS = {name: value for value, names in _TINY_FIELDS.items() for name in names}
TINY_FIELDS.update(vocab_size=300, vocab=300, num_key_value_heads=2)
# the input width of Dots 3's audio adapter, which must equal its hidden size (its *_dim are by name)
TINY_FIELDS.update(adapter_input_size=64)
# Qwen4-Exp's sparse-attention indexer, unset by the defaults but built on its indexed layers (one key head)
TINY_FIELDS.update(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                   indexer_compress_ratio=4)
# counts of layers that only the real depth has room for: the first of two MoE (LFM2-MoE), none of two
# sharing another layer's K/V (Gemma 3n: each layer type needs a producer before the sharing ones)
TINY_FIELDS.update(num_dense_layers=1, num_kv_shared_layers=0)
# fields a real checkpoint sets that neither the defaults nor a rule can know: a hybrid's layer kinds
# (LFM2 and LFM2-8B-A1B mix conv and attention layers), a field the modeling reads that the config class does
# not declare or leaves None (DBRX's attention reads rope_theta, clamps by clip_qkv: dbrx-instruct's),
# a size the modeling assumes (Cohere Compass's rotary sections, 22+22+20 of 64 frequency pairs in
# transformers 5.17: its checkpoints' head_dim of 128)
CHECKPOINT_FIELDS = {"lfm2_moe": {"layer_types": ["conv", "full_attention"]},
                     "lfm2": {"layer_types": ["conv", "full_attention"]},  # LFM2-1.2B: 10 conv, 6 attention
                     "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8}},
                     "cohere_compass_text": {"head_dim": 128}}


def _table_name(config, name: str) -> str | None:
    """The table's name (TINY_FIELDS) for the field `name` of `config`, None if it is no size: its
    own, an alias the config class maps to it (n_group: num_expert_group), else the longest table
    name it ends with (linear_num_heads, index_head_dim, o_lora_rank, encoder_hash_byte_group_vocab)
    or, for a name of several words, starts with (hidden_size_global)."""
    if name in TINY_FIELDS:
        return name
    alias = next((a for a, real in getattr(config, "attribute_map", {}).items()
                  if real == name and a in TINY_FIELDS), None)
    words = [k for k in TINY_FIELDS if name.endswith("_" + k) or ("_" in k and name.startswith(k + "_"))]
    return alias or (max(words, key=len) if words else None)


def _shrunk(config) -> dict:
    """Keyword overrides that make `config` (a transformers config with its defaults) tiny."""
    from transformers import PretrainedConfig

    fields = config.to_dict()
    layers = next((fields[k] for k in _TINY_FIELDS[2][:4] if isinstance(fields.get(k), int)), None)
    out, spare = {}, iter(range(TINY_FIELDS["vocab_size"] - 1, 250, -1))
    for name, value in fields.items():
        tiny = TINY_FIELDS.get(_table_name(config, name))
        if isinstance(vars(config).get(name), PretrainedConfig):  # (getattr refuses a per-layer field)
            sub = vars(config)[name]
            out[name] = {**sub.to_diff_dict(), **_shrunk(sub)}  # (5.17's sub-configs refuse the base keys)
        elif tiny is not None and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[name] = min(value, tiny)
        elif name in TINY_FIELDS and value is None and name not in ("q_lora_rank", "num_key_value_heads"):
            out[name] = TINY_FIELDS[name]  # derived or required, left unset by the defaults (head_dim)
        elif name.endswith(("token_id", "token_index")) and isinstance(value, int) and value >= 250:
            out[name] = next(spare)  # special tokens (an image's, ...) above the ids of the test's text
        elif isinstance(value, list) and layers and len(value) == layers and layers > 2:
            # per-layer patterns (layer_types, ...): the first layer of each kind, so a hybrid keeps both
            kinds = [i for i, v in enumerate(value) if v not in value[:i]][:2]
            kept = [value[i] for i in (kinds + [0, 0])[:2]]  # a size per layer (Gemma 3n's intermediate_size)
            out[name] = [min(v, tiny) if tiny and type(v) is int else v for v in kept]
    if "kv_lora_rank" in fields:  # multi-head latent attention: K/V heads = query heads, rope head_dim
        out["num_key_value_heads"] = out.get("num_attention_heads", 4)
        if "head_dim" in fields:
            out["head_dim"] = out.get("qk_rope_head_dim", 8)
    if "num_key_value_heads" in fields and fields["num_key_value_heads"] is None:  # None: as many as query heads
        out["num_key_value_heads"] = out.get("num_attention_heads", 4)  # (Nemotron's modeling needs the number)
    if "num_key_value_heads" in out and out.get("num_attention_heads", 4) % out["num_key_value_heads"]:
        out["num_key_value_heads"] = out.get("num_attention_heads", 4)
    for name in _derived_by_class(config, out, {n for n in out if _table_name(config, n) not in (n, None)}):
        del out[name]
    out.update(_kept_relations(fields, out))
    if getattr(config, "is_heterogeneous", False):
        out["per_layer_config"] = _shrunk_per_layer(config, fields, out)
    return {**out, **_unset_by_defaults(fields, out)}


def _derived_by_class(config, out: dict, names: set) -> set:
    """Those of the shrunk fields `names` that the config class derives itself from the other
    sizes (qk_head_dim = qk_nope_head_dim + qk_rope_head_dim, Zamba's attention_hidden_size =
    2 x hidden_size): a probe built without them has them changed from the defaults."""
    try:
        probe = type(config)(**{k: v for k, v in out.items() if k not in names})
    except Exception:  # noqa: BLE001  the class refuses the probe: nothing is known to be derived
        return set()
    return {n for n in names if getattr(probe, n, None) != getattr(config, n)}


_HEADS = r"(num_attention_heads|num_heads|n_heads?)$"  # a count of query heads (not key/value heads)


def _kept_relations(defaults: dict, out: dict) -> dict:
    """Fields that the defaults derive from the shrunk sizes, rederived so the tiny config is as
    consistent as the defaults: a head width (heads x head_dim = hidden_size x expand, Mamba-2's
    inner width) and a list of sizes whose sum or product is a shrunk size (Reformer's axial
    position embeddings: widths summing to hidden_size, a shape multiplying to the positions)."""
    import math
    import re

    derived = {}
    widths = [n for n in out if "hidden_size" in n or n in _TINY_FIELDS[64]]
    factors = [1, *sorted({v for n, v in defaults.items() if type(v) is int and n.endswith("expand")})]
    for heads in (n for n in out if re.search(_HEADS, n)):
        dim = re.sub(_HEADS, "head_dim", heads)  # linear_num_heads: linear_head_dim
        if isinstance(defaults.get(dim), int) and dim in out:
            width = next(((w, f) for w in widths for f in factors
                          if defaults[heads] * defaults[dim] == defaults[w] * f), None)
            if width and out[width[0]] * width[1] % out[heads] == 0:
                derived[dim] = out[width[0]] * width[1] // out[heads]
    for name, value in defaults.items():
        if name in out or not isinstance(value, (list, tuple)) or len(value) < 2 \
                or not all(type(v) is int and v > 0 for v in value):
            continue
        for size in (n for n in out if type(defaults.get(n)) is int and defaults[n] != out[n]):
            if sum(value) == defaults[size]:  # widths, scaled
                scaled = [max(1, v * out[size] // defaults[size]) for v in value[:-1]]
                derived[name] = [*scaled, out[size] - sum(scaled)]
            elif math.prod(value) == defaults[size]:  # a shape: halve its largest factor
                shape = list(value)
                while math.prod(shape) > out[size] and max(shape) % 2 == 0:
                    shape[shape.index(max(shape))] //= 2
                derived[name] = shape
    return derived


def _unset_by_defaults(fields: dict, tiny: dict) -> dict:
    """What every real checkpoint sets and the config class leaves empty: the default RoPE (one
    per layer type where the class keys it so: Cohere Compass)."""
    if fields.get("rope_parameters") != {}:
        return {}
    rope, types = {"rope_type": "default", "rope_theta": 10000.0}, tiny.get("layer_types", fields.get("layer_types"))
    return {"rope_parameters": {t: dict(rope) for t in set(types)} if isinstance(types, list) else rope}


def _kept_layers(config, layers: int) -> list:
    """The two layers a tiny config keeps of a heterogeneous one: the first of each kind (layer
    type, else per-layer overrides), as the per-layer patterns' rule keeps them."""
    overrides = config._heterogeneity_spec.per_layer_overrides
    types = config.to_dict().get("layer_types")
    kinds = [types[i] if isinstance(types, list) and len(types) == layers else repr(overrides.get(i))
             for i in range(layers)]
    first = [i for i, k in enumerate(kinds) if k not in kinds[:i]][:2]
    return (first + [0, 0])[:2]


def _shrunk_per_layer(config, fields: dict, tiny: dict) -> dict:
    """`per_layer_config` (a layer's sizes that differ from the global ones) for the kept layers: a
    size in the same ratio to the tiny global as the real one to the real global (Gemma 4's
    full-attention layers keep twice the head_dim), else shrunk as a global one; a size the layer
    has as the sum of two other head widths, one of them its own, stays their sum (Dots 3's
    sliding head_dim = nope + rope)."""
    layers = next(fields[k] for k in _TINY_FIELDS[2][:4] if isinstance(fields.get(k), int))
    out = {}
    for new, old in enumerate(_kept_layers(config, layers)):
        overrides = config._heterogeneity_spec.per_layer_overrides.get(old, {})
        layer = {}
        for name, value in overrides.items():
            real, small = fields.get(name), tiny.get(name, fields.get(name))
            if name in TINY_FIELDS and isinstance(value, int) and isinstance(real, int) and real > 0:
                scaled = small * value / real
                layer[name] = int(scaled) if scaled >= 1 and scaled == int(scaled) else min(value, TINY_FIELDS[name])
            else:
                layer[name] = value
        real, small = {**fields, **overrides}, {**fields, **tiny, **layer}
        sizes = [n for n in (*_TINY_FIELDS[16], *_TINY_FIELDS[8]) if isinstance(real.get(n), int)]  # head widths
        for name in sizes:
            parts = [(a, b) for a in overrides for b in sizes if a in sizes and len({name, a, b}) == 3
                     and real[name] == real[a] + real[b]]
            if name not in overrides and parts:
                layer[name] = small[parts[0][0]] + small[parts[0][1]]
        out[str(new)] = layer
    return out


def tiny_config(model_type: str):
    """A tiny random-init config of any causal-LM `model_type` of the installed transformers: the
    table's own (ARCHS) where it has one, else derived from the config class's defaults."""
    from transformers import AutoConfig

    if model_type in ARCHS:
        return hf_config(model_type)
    defaults = AutoConfig.for_model(model_type)
    shrunk = _shrunk(defaults)
    for name, value in CHECKPOINT_FIELDS.get(model_type, {}).items():  # a sub-config's fields join its own
        shrunk[name] = {**shrunk[name], **value} if isinstance(shrunk.get(name), dict) else value
    return AutoConfig.for_model(model_type, **{**shrunk, **_user_choices(defaults), "bos_token_id": 0,
                                               "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": False,
                                               "is_decoder": True})


def _user_choices(config) -> dict:
    """What a user sets in model.config where the defaults leave a choice open: the language of the
    inputs of a model with an adapter per language (shardtune refuses the config until then), and
    the sizes of a model that trains only on rows of one length (Reformer: the product of its axial
    position shape, a multiple of its attention chunks), set for the test's row (sum(DOCS))."""
    import math

    from shardtune.families import LANGUAGE_FIELDS

    field, choices = LANGUAGE_FIELDS
    languages = getattr(config, choices, None)
    out = {field: list(languages)[0]} if languages and getattr(config, field, "") is None else {}
    length = sum(DOCS)
    if getattr(config, "axial_pos_embds", False):
        out["axial_pos_shape"] = [math.gcd(length, 4), length // math.gcd(length, 4)]
    out.update({n: math.gcd(v, length) for n, v in config.to_dict().items()
                if n.endswith("chunk_length") and type(v) is int})
    return out


# ---- shared by the architecture tests (tests/test_architectures.py, tests/test_every_architecture.py)
DOCS = (9, 23, 14, 6)  # document lengths of the packed row


def packed_batch(rows):
    """A packed row of documents, as data.collate makes it: positions restart per document and
    each document's first token has no label."""
    import torch

    from shardtune.data.docmask import positions
    from shardtune.data.formats import IGNORE_INDEX

    ids = torch.tensor([sum(rows, [])])
    starts = torch.tensor([0, *[len(r) for r in rows[:-1]]]).cumsum(0)
    labels = ids.clone()
    labels[0, starts[1:]] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels,
            "position_ids": torch.from_numpy(positions(starts[1:].numpy(), ids.size(1)))[None]}


def packed_vs_alone(model, batch, rows) -> float:
    """The largest difference between a document's logits inside the packed row (every row of
    the batch holds the same documents) and alone."""
    import torch

    from shardtune.data import docmask

    with torch.no_grad():
        packed = model(**docmask.model_inputs(model, batch)).logits
        start, worst = 0, 0.0
        for row in rows:
            alone = model(input_ids=torch.tensor([row]), use_cache=False).logits
            worst = max(worst, float((packed[:, start:start + len(row)] - alone).abs().max()))
            start += len(row)
    return worst


def run_config(model_type, *extra):
    """A RunConfig of `model_type` (its tiny config where the table has one; the rest pass their
    hf config to whatever takes the RunConfig)."""
    import json

    from shardtune.config.load import load_config

    config = arch_config(model_type) if model_type in ARCHS else {"model_type": model_type}
    return load_config(None, [f"model.config={json.dumps(config)}", "data.path=unused",
                              "data.seq_len=32", "train.micro_batch_size=1", "device=cpu", *extra])


def optimizer_step(model_type, model, batch) -> set:
    """One optimizer step through shardtune's train_step (finite loss and gradient norm); returns
    the names of the parameters it moved."""
    import torch

    from shardtune.distributed.process_group import Dist
    from shardtune.train.optim import build_optimizer
    from shardtune.train.step import train_step

    cfg = run_config(model_type, "train.global_batch_size=1", "train.lr=1e-2")
    model.train()
    optimizer = build_optimizer(model, cfg.train, torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    out = train_step(model, optimizer, None, [batch], cfg, Dist(0, 1, 1, torch.device("cpu")), count_tokens=True)
    assert torch.isfinite(out.loss_sum) and torch.isfinite(out.grad_norm), model_type
    return {n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])}


def _stand_in_flash(query_states, key_states, value_states, attention_mask, query_length, is_causal=True,
                    dropout=0.0, position_ids=None, softmax_scale=None, sliding_window=None, softcap=None,
                    cu_seq_lens_q=None, **_):
    """transformers' `_flash_attention_forward` on the CPU, dense: it keeps documents apart from what
    the real one reads, in its order (a padding mask; the document lengths; position ids that
    restart, in a batch of one row only), and from nothing else."""
    import torch
    from transformers.modeling_flash_attention_utils import _is_packed_sequence

    batch, length, heads, dim = query_states.shape
    groups = heads // key_states.shape[2]
    keys, values = (x.repeat_interleave(groups, dim=2).float() for x in (key_states, value_states))
    scores = torch.einsum("bqhd,bkhd->bhqk", query_states.float(), keys) * (softmax_scale or dim ** -0.5)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    index = torch.arange(length)
    allowed = (index[None, :] <= index[:, None]).expand(batch, length, length)
    if sliding_window:
        allowed = allowed & (index[:, None] - index[None, :] < sliding_window)
    document = None
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, :]
    elif cu_seq_lens_q is not None:
        document = torch.bucketize(torch.arange(batch * length), cu_seq_lens_q[1:], right=True).view(batch, length)
    elif _is_packed_sequence(position_ids, batch):
        document = (torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    if document is not None:
        allowed = allowed & (document[:, :, None] == document[:, None, :])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), values).to(query_states.dtype).contiguous()


@contextlib.contextmanager
def flash_stand_in(model):
    """`model` (built with sdpa or eager) runs as with flash_attention_2 until the block ends, its
    kernel replaced by `_stand_in_flash`: what a model hands its flash path, checked without CUDA.
    Attention classes of their own for flash (Falcon's, GPT-J's) take the place of the others."""
    import sys

    import transformers.integrations.flash_attention as shared
    import transformers.modeling_flash_attention_utils as utils

    module = sys.modules[type(model).__module__]
    configs = {id(c): c for c in [model.config, *(getattr(m, "config", None) for m in model.modules())]
                if hasattr(c, "_attn_implementation_internal")}.values()
    tables = [t for name, t in vars(module).items() if name.endswith("ATTENTION_CLASSES") and isinstance(t, dict)]
    swapped = [(m, type(m)) for m in model.modules() for t in tables
               if "flash_attention_2" in t and type(m) in t.values() and type(m) is not t["flash_attention_2"]]
    before = [(c, c._attn_implementation_internal) for c in configs]
    saved = [(owner, name, vars(owner).get(name)) for owner in (utils, shared, module)
             for name in ("_flash_attention_forward", "get_target_dtype") if name in vars(owner) or owner is module]
    try:
        for owner, name, _ in saved:  # float32 on the CPU: no dtype to cast to
            setattr(owner, name, _stand_in_flash if name == "_flash_attention_forward" else lambda *a: None)
        for m, _ in swapped:
            m.__class__ = next(t["flash_attention_2"] for t in tables if type(m) in t.values())
            m._flash_attn_uses_top_left_mask = False
        for c, _ in before:
            c._attn_implementation_internal = "flash_attention_2"
        yield model
    finally:
        for c, value in before:
            c._attn_implementation_internal = value
        for m, cls in swapped:
            m.__class__ = cls
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def flash_vs_alone(model, rows) -> tuple[float, float]:
    """packed_vs_alone under `flash_stand_in`, for a micro-batch of one packed row and of two."""
    import torch

    one = packed_batch(rows)
    with flash_stand_in(model):
        return packed_vs_alone(model, one, rows), packed_vs_alone(model, {k: torch.cat([v, v]) for k, v in one.items()},
                                                                  rows)


def check_flash_documents(model_type, model, rows) -> None:
    """Under flash attention (the CPU stand-in), a packed document computes what it computes alone
    in a micro-batch of one row and of two, or docmask refuses that in one line (and it really mixes).
    A model without flash attention is refused it by transformers."""
    from shardtune.config.schema import DataConfig
    from shardtune.data import docmask
    from shardtune.errors import UserError

    if not getattr(model, "_supports_flash_attn", False):
        return
    for worst, batch_rows in zip(flash_vs_alone(model, rows), (1, 2), strict=True):
        refused = None
        with flash_stand_in(model):
            try:
                docmask.check(DataConfig(path="x", document_mask=True, seq_len=sum(DOCS)), model.config, batch_rows)
            except UserError as exc:
                refused = str(exc)
        if refused is None:
            assert worst <= 1e-5, (f"{model_type}: flash attention mixes the packed documents of {batch_rows} "
                                   f"row(s) ({worst}): families.FLASH_DOCUMENTS must say so")
        else:
            assert worst > 1e-3 and "\n" not in refused and "flash_attention_2" in refused, (model_type, worst, refused)


def check_long_rows(model_type, model) -> None:
    """A padding-free row of documents each within the model's positions but together longer (3 of
    100 to 120 tokens, for the tiny configs' 128): each computes what it computes alone, or docmask
    refuses such rows in one line (and the forward really fails or mixes them)."""
    import torch

    from shardtune.config.schema import DataConfig
    from shardtune.data import docmask
    from shardtune.errors import UserError

    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in (100, 90, 120)]
    try:
        worst = packed_vs_alone(model, packed_batch(docs), docs)
    except (RuntimeError, ValueError, IndexError) as exc:
        worst = exc
    try:
        docmask.check(DataConfig(path="x", format="instruct", padding_free=True, seq_len=120), model.config, 3)
    except UserError as exc:
        assert "\n" not in str(exc) and (isinstance(worst, Exception) or worst > 1e-3), (model_type, worst, str(exc))
        return
    assert not isinstance(worst, Exception) and worst <= 1e-5, f"{model_type}: a padding-free row of 310: {worst}"
