"""Document masking: rows that hold several documents (packed blocks, padding-free batches)
keep every document to itself. Positions restart at 0 at every document, and attention
stays inside it, through the model's own packed-sequence support in transformers:

- most models hand `position_ids` to `create_causal_mask`, which sees the restarts and builds
  a block-causal mask (sdpa, eager) — nothing more to do;
- OPT and Falcon compute their masks without them, so the block-causal mask is built with the same
  transformers function and passed in as a 4-D mask;
- flash-attention (CUDA) gets the cumulative document lengths and runs its varlen kernel (where a
  model's own flash layers drop them, families.FLASH_DOCUMENTS says what they see instead).

Architectures and attention implementations not verified here are refused up front.
"""

from __future__ import annotations

from shardtune.config.schema import DataConfig
from shardtune.data.formats import IGNORE_INDEX
from shardtune.errors import UserError
from shardtune.families import FLASH_DOCUMENTS, PACKED_POSITIONS, document_mask_limit, family, with_document_mask

FLASH = ("flash_attention_2", "flash_attention_3")
ATTENTION = (None, "sdpa", "eager", *FLASH)  # None: transformers' default (sdpa where the model has it)


def check(cfg: DataConfig, hf_config, rows: int | None = None) -> None:
    """Refuse document masking where it would silently not happen (before any data work). `rows`:
    the most sequences one forward takes (train's or eval's micro-batch), None while not known (auto)."""
    if not cfg.masks_documents:
        return
    key = "data.padding_free" if cfg.padding_free else "data.document_mask"
    fix = "set data.padding_free=false" if cfg.padding_free else "set data.document_mask=false"
    model_type = getattr(hf_config, "model_type", None)
    if document_mask(model_type) is None:
        raise UserError(f"{key} needs a model whose attention can be kept inside each document; model type "
                        f"{model_type!r} is not one (README 'Architectures' says which {len(with_document_mask())} "
                        f"are, e.g. llama, qwen3, mistral, gpt2); {fix}")
    attn = getattr(hf_config, "_attn_implementation", None)
    if attn not in ATTENTION:
        raise UserError(f"{key} works with attention implementations {', '.join(a for a in ATTENTION if a)}, "
                        f"not {attn!r}; pick one of them in model.config, or {fix}")
    one_row = cfg.padding_free or rows == 1  # padding-free: a micro-batch is one row
    if attn in FLASH and model_type in FLASH_DOCUMENTS and not (FLASH_DOCUMENTS[model_type] and one_row):
        where = "only in a micro-batch of one row (set train.micro_batch_size=1 and eval.micro_batch_size=1)" \
            if FLASH_DOCUMENTS[model_type] else "in no batch (a token would attend to the documents before it)"
        raise UserError(f"{key} with {attn}: {model_type}'s flash-attention layers see the document boundaries "
                        f"{where}; use sdpa or eager in model.config, or {fix}")
    limit = document_mask_limit(hf_config)
    longest = cfg.seq_len * (rows or 1) if cfg.padding_free else cfg.seq_len  # a row's tokens, at most
    if limit is not None and longest > limit[0]:
        shorter = f"keep rows to {limit[0]} tokens (data.seq_len" + \
            (" x micro-batch size) or " if cfg.padding_free else ") or ") if limit[0] else ""
        raise UserError(f"{key}: {limit[1]}; {shorter}{fix}")


def document_mask(model_type: str | None) -> str | None:
    """How this model type's forward learns about the documents (families.Family.document_mask);
    each verified type is covered by the logits test (a document inside a packed row == alone)."""
    known = family(model_type)
    if known:
        return known.document_mask
    return "position_ids" if model_type in PACKED_POSITIONS else None


def positions(starts, length: int):
    """int64 numpy position ids of a row of `length` tokens whose documents begin at `starts`
    (sorted offsets; 0 is implied): 0, 1, 2, ... restarting at every start."""
    import numpy as np

    starts = np.union1d([0], np.asarray(starts, dtype=np.int64))
    index = np.arange(length, dtype=np.int64)
    return index - starts[np.searchsorted(starts, index, side="right") - 1]


def flatten(input_ids: list, labels: list):
    """Padding-free layout of one micro-batch: (1, total) input_ids, labels and position_ids
    with the examples end to end. An example's first token gets no label, so no example is
    asked to predict the next one: the loss is the padded batch's."""
    import torch

    lengths = [len(x) for x in input_ids]
    ids = torch.cat(list(input_ids))[None]
    labs = torch.cat(list(labels))[None].clone()
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    labs[0, starts] = IGNORE_INDEX
    pos = torch.from_numpy(positions(starts[1:].numpy(), ids.size(1)))[None]
    return ids, labs, pos


def model_inputs(model, batch) -> dict:
    """Keyword arguments of the model's forward for a collated batch."""
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
    if "position_ids" not in batch:
        return inputs
    position_ids = batch["position_ids"]
    config = model.config
    inputs["position_ids"] = position_ids
    if config._attn_implementation in FLASH:
        from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids)
        # the varlen kernel wants the longest document as a number: one host sync per micro-batch
        inputs.update(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=int(max_q), max_length_k=int(max_k))
    elif document_mask(config.model_type) == "mask_4d":
        import torch
        from transformers.masking_utils import create_causal_mask

        shape_only = torch.empty(*position_ids.shape, 0, device=position_ids.device)  # size, dtype and device
        inputs["attention_mask"] = create_causal_mask(config, shape_only, None, None, position_ids=position_ids)
    return inputs
