"""Model and tokenizer: where they come from, how big a sequence they take, and how the
weights reach every rank without N full copies in host memory.

Every rank builds the model skeleton on the meta device; only rank 0 reads (or randomly
initialises) the full weights, which are then broadcast shard by shard after `fully_shard`.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from shardtune.config.schema import ModelConfig
from shardtune.errors import UserError, first_line
from shardtune.families import (
    HEADS,
    KV_HEADS,
    LANGUAGE_FIELDS,
    config_value,
    set_layer_count,
    text_config,
)
from shardtune.model.config_values import check_ranges, check_sizes
from shardtune.model.files import (
    TOKENIZER_FILES,
    TOKENIZER_JSON,
    check_json_files,
    check_model_folder,
    check_model_source,
    hub_hint,
    reason,
    weight_files,
)
from shardtune.model.weights_fit import check_weights_fit
from shardtune.noise import transformers_warnings


def load_hf_config(cfg: ModelConfig, local_files_only: bool = False, weights: bool = True):
    """The transformers config of the model, with `model.config` overrides applied
    (`local_files_only`: a local folder or the Hugging Face cache, never the network), checked;
    `weights`: a local folder's weights too (False: `plan`, which reads only the config).
    What transformers logs about it meanwhile (a rope factor below 1) is shown once the checks pass:
    a refusal stays one line."""
    with transformers_warnings() as said:
        hf_config = _load_checked(cfg, local_files_only, weights and not cfg.random_init)
    for line in said:
        logging.getLogger("transformers").warning(line)
    return hf_config


def _load_checked(cfg: ModelConfig, local_files_only: bool, weights: bool):
    from transformers import AutoConfig

    overrides = dict(cfg.config)
    if cfg.name_or_path is None:
        model_type = overrides.pop("model_type", None)
        if model_type is None:
            raise UserError("model.config needs model_type (e.g. model.config.model_type=gpt2) "
                            "when model.name_or_path is not set")
        if not isinstance(model_type, str) or any(not isinstance(k, str) for k in overrides):
            raise UserError(f"model.config must map field names to values with a model_type name, got "
                            f"model_type={model_type!r} and keys {list(overrides)[:5]}; check model.config")
        try:
            with _quiet_type_default_ids(overrides):
                hf_config = AutoConfig.for_model(model_type, **overrides)
        except ValueError as exc:
            if "Unrecognized model" in str(exc):
                raise UserError(f"model.config.model_type={model_type!r} is unknown to transformers "
                                f"({reason(exc)})") from None
            raise UserError(f"model.config is refused by transformers ({reason(exc)}); check model.config") from None
        except Exception as exc:  # the config class's own validation (TypeError, strict-dataclass errors)
            raise UserError(f"model.config is refused by transformers ({reason(exc)}); check model.config") from None
        check_sizes(hf_config, cfg)
        check_ranges(hf_config, cfg)
        check_buildable(hf_config, cfg.trust_remote_code, "model.config")
        return hf_config
    folder = Path(cfg.name_or_path)
    check_model_source(cfg.name_or_path, "model.name_or_path")
    if folder.is_dir():  # checked whole now, on every rank, so none starts building on a broken folder
        check_model_folder(folder, weights=weights)
    try:
        hf_config = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code,
                                               local_files_only=local_files_only)
    except OSError as exc:
        if folder.is_dir():
            raise UserError(f"model folder {cfg.name_or_path!r} could not be read ({first_line(exc)}); "
                            "give a Hugging Face model folder (config.json and weights)") from None
        raise UserError(f"model {cfg.name_or_path!r} not found; {hub_hint(cfg.name_or_path)}") from None
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise UserError(f"model {cfg.name_or_path!r} needs custom code; set model.trust_remote_code=true "
                            "if you trust it") from None
        if not folder.is_dir():
            raise
        raise UserError(f"{str(folder / 'config.json')!r} is not a config transformers can read ({reason(exc)}); "
                        "re-download or re-export the model") from None
    except Exception as exc:  # a config class's own validation of the file's values
        if not folder.is_dir():
            raise
        raise UserError(f"{str(folder / 'config.json')!r} is refused by transformers ({reason(exc)}); "
                        "re-download or re-export the model") from None
    for key, value in overrides.items():
        if not isinstance(key, str) or not hasattr(hf_config, key):
            raise UserError(f"model.config.{key} is not a field of {type(hf_config).__name__}; check the name")
        try:  # a read-only property (use_return_dict) or a field the config class validates (num_labels)
            setattr(hf_config, key, value)
        except Exception as exc:  # noqa: BLE001 - whichever the config class raises
            raise UserError(f"model.config.{key}={value!r} is refused by transformers ({reason(exc)}); "
                            "check model.config") from None
    check_sizes(hf_config, cfg)
    check_ranges(hf_config, cfg)
    check_buildable(hf_config, cfg.trust_remote_code, f"model {cfg.name_or_path!r}"
                    + (" with model.config" if overrides else ""))
    if folder.is_dir() and weights and (files := weight_files(folder)):
        check_weights_fit(folder, files, build_meta_model(hf_config, cfg.trust_remote_code))
    return hf_config


def load_generation_config(source: str | Path | None, hf_config, ends: list[int | str] = ()):
    """The model's generation settings: the generation_config.json of `source` (a model folder, a
    Hub id, a checkpoint) where it has one, else those transformers derives from `hf_config`.
    final/, checkpoints and exports write these, so generation afterwards stops and samples as the
    model's own settings say: derived from config.json, a list of end-of-sequence ids (Llama 3's
    end of turn) was cut to its first, and the sampling defaults were dropped. `ends`: the token
    ids training taught answers to end with (data.chat.trained_ends), added to its EOS ids: a
    chat run on a base model learns to end at <|im_end|> while the base stops only at its
    <|endoftext|>, and another tool's generate on final/ ran on past every reply."""
    from transformers import GenerationConfig

    generation = None
    if source is not None and (not Path(source).is_dir() or (Path(source) / "generation_config.json").is_file()):
        try:
            generation = GenerationConfig.from_pretrained(source)
        except (OSError, ValueError):  # a Hub repo without one (or out of reach): derived, as before
            pass
    generation = generation or GenerationConfig.from_model_config(hf_config)
    have = generation.eos_token_id
    have = list(have) if isinstance(have, (list, tuple)) else [] if have is None else [have]
    eos = list(dict.fromkeys([*have, *(e for e in ends if isinstance(e, int))]))  # a text of several tokens: no id
    if len(eos) > len(have):
        generation.eos_token_id = eos[0] if len(eos) == 1 else eos
    return generation


# the special-token ids match_tokenizer sets from the tokenizer on a config built from model.config
TOKENIZER_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@contextlib.contextmanager
def _quiet_type_default_ids(overrides: dict):
    """transformers warns at construction about a model type's default special-token ids outside
    a smaller vocabulary given in model.config (GPT-2's 50256 in the quickstart's 2048); match_tokenizer
    replaces them with the tokenizer's, so those lines are about values no run uses. An id the
    user gave still warns."""
    starts = tuple(f"Model config: {name} must be" for name in TOKENIZER_IDS if name not in overrides)

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(starts)

    logger = logging.getLogger("transformers.configuration_utils")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def check_buildable(hf_config, trust_remote_code: bool, what: str) -> None:
    """Refuse, before any data or weights are read, a config that has no causal-LM head or that
    transformers cannot build (e.g. a hidden size the attention heads do not divide). The build is
    of a one-layer copy on the meta device (no memory, milliseconds); only if that fails is the
    whole config tried, so a config valid at full depth is never refused."""
    import copy

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    remote = trust_remote_code and "AutoModelForCausalLM" in (getattr(hf_config, "auto_map", None) or {})
    if not remote and type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(f"{what} is a {hf_config.model_type!r} model, which has no causal-LM head in transformers "
                        "(AutoModelForCausalLM); pick a decoder (causal) language model")
    check_input_language(hf_config)
    heads, kv_heads = config_value(hf_config, *HEADS), config_value(hf_config, *KV_HEADS)
    if heads and kv_heads and heads % kv_heads:  # builds, then fails at its first forward
        raise UserError(f"{what} has {heads} attention heads, not a multiple of its {kv_heads} key/value heads; "
                        f"set model.config.num_key_value_heads (or the model's name for it) to a divisor of {heads}")
    shallow = copy.deepcopy(hf_config)
    with transformers_warnings() as said:  # they come again at the real build, if it is not refused
        try:
            set_layer_count(shallow, 1)
            model = build_meta_model(shallow, trust_remote_code)
        except Exception:
            model = build_meta_model(hf_config, trust_remote_code, what)
    if (empty := next((n for n, p in model.named_parameters() if p.numel() == 0), None)) is not None:
        shape = list(model.get_parameter(empty).shape)  # a size of 0 (n_inner, intermediate_size, ...)
        raise UserError(f"{what} makes weight {empty} empty (shape {shape}): a size in its config is 0; set that "
                        "size to 1 or more")
    # an encoder with an LM head (BERT, RoBERTa) attends both ways unless told it decodes, as the
    # library says when it builds one: it would learn to copy the next token, not to predict it
    if getattr(model.config, "is_decoder", None) is False and any("is_decoder=True" in line for line in said):
        raise UserError(f"{what} is a {hf_config.model_type!r} model with is_decoder=false: it attends to later "
                        "tokens, so it cannot learn to predict them; set model.config.is_decoder=true")
    # the same for a decoder made an encoder by its config (Gemma's use_bidirectional_attention, set by
    # EmbeddingGemma; Gemma 4's "all", where "vision" keeps the text causal)
    both_ways = getattr(text_config(hf_config), "use_bidirectional_attention", None)
    if both_ways is True or both_ways == "all":
        unset = "false" if both_ways is True else "null"
        raise UserError(f"{what} has use_bidirectional_attention={str(both_ways).lower()}: it attends to later "
                        f"tokens (an embedding model), so it cannot learn to predict them; set "
                        f"model.config.use_bidirectional_attention={unset}")


def check_input_language(hf_config) -> None:
    """A model with an adapter per language needs the language of its inputs in its config
    (families.LANGUAGE_FIELDS): shardtune passes no language ids, so its forward would fail."""
    field, choices = LANGUAGE_FIELDS
    languages = list(getattr(hf_config, choices, None) or [])
    if not hasattr(hf_config, field) or not languages:
        return
    language = getattr(hf_config, field)
    if language not in languages:
        got = " is not set" if language is None else f"={language!r} is not one of its languages"
        raise UserError(f"model.config.{field}{got}: this {hf_config.model_type} model has an adapter per "
                        f"language ({', '.join(map(str, languages[:8]))}) and needs its inputs' language; set "
                        f"model.config.{field}={languages[0]} (or the language of your data)")


def match_tokenizer(hf_config, tokenizer, cfg: ModelConfig) -> None:
    """A model built from a config alone (no weights) takes its vocabulary and special tokens
    from the tokenizer, unless model.config names a vocab_size."""
    if cfg.name_or_path is not None:
        return
    text = text_config(hf_config)  # a multimodal config's language model holds its vocabulary
    if "vocab_size" not in cfg.config:
        text.vocab_size = len(tokenizer)
    for obj in {id(o): o for o in (hf_config, text)}.values():  # TOKENIZER_IDS
        obj.bos_token_id = tokenizer.bos_token_id
        obj.eos_token_id = tokenizer.eos_token_id
        obj.pad_token_id = tokenizer.pad_token_id


def check_vocab(hf_config, tokenizer, fix: str, whose: str = "the tokenizer", model: str = "the model") -> None:
    """A tokenizer with more tokens than the model's embedding rows: a token past them fails deep
    in torch (an index error) at the first forward that meets it."""
    vocab = config_value(hf_config, "vocab_size")
    if vocab is not None and len(tokenizer) > vocab:
        raise UserError(f"{whose} has {len(tokenizer)} tokens but {model} only {vocab}; {fix}")


def max_positions(hf_config) -> int | None:
    value = config_value(hf_config, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
    return value if value and value > 0 else None


def check_seq_len(hf_config, seq_len: int, virtual_tokens: int = 0) -> None:
    """`virtual_tokens`: prefix/prompt tuning's, which take positions before the sequence's."""
    limit = max_positions(hf_config)
    if limit is not None and seq_len + virtual_tokens > limit:
        room = limit - virtual_tokens  # positions left for the sequence, which needs at least 2
        if virtual_tokens and room < 2:
            fix = (f"set peft.num_virtual_tokens={limit - seq_len} or less" if seq_len < limit else
                   f"set data.seq_len below {limit} and peft.num_virtual_tokens to fit beside it")
            raise UserError(f"peft.num_virtual_tokens={virtual_tokens} takes all of the model's {limit} positions, "
                            f"leaving none for data.seq_len={seq_len}; {fix}")
        if virtual_tokens:
            raise UserError(f"data.seq_len={seq_len} plus peft's {virtual_tokens} virtual tokens is above the "
                            f"model's maximum of {limit} positions; set data.seq_len={room} or "
                            "less, or lower peft.num_virtual_tokens")
        raise UserError(f"data.seq_len={seq_len} is above the model's maximum of {limit} positions; "
                        f"set data.seq_len={limit} or less")


VOCABULARY_PROBE = "The quick brown fox jumps over the lazy dog."  # any real tokenizer makes tokens of it


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    source = cfg.tokenizer or cfg.name_or_path
    if source is None:
        raise UserError("a random-init model needs a tokenizer: set model.tokenizer=<hub id or folder>")
    check_model_source(source, "model.tokenizer" if cfg.tokenizer else "model.name_or_path")
    local = Path(source).is_dir()
    if local:
        check_json_files(Path(source), TOKENIZER_JSON)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        if local:
            raise UserError(f"tokenizer folder {source!r} could not be read ({first_line(exc)}); give a folder "
                            "with tokenizer.json or the tokenizer's vocabulary files") from None
        raise UserError(f"tokenizer {source!r} not found; {hub_hint(source)}") from None
    except Exception as exc:  # the tokenizers library's parse errors are plain Exceptions
        if not local:
            raise
        if not any((Path(source) / name).is_file() for name in TOKENIZER_FILES):  # nothing to be damaged
            raise UserError(f"folder {source!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}, ...); "
                            "copy the model's tokenizer files there, or set model.tokenizer to a folder or hub id "
                            "that has them") from None
        raise UserError(f"tokenizer folder {source!r} is damaged ({type(exc).__name__}: {first_line(exc)}); "
                        "re-download or re-save the tokenizer") from None
    if tokenizer.eos_token_id is None:
        raise UserError(f"tokenizer {source!r} has no end-of-sequence token; pick a tokenizer that has one")
    if not tokenizer(VOCABULARY_PROBE, add_special_tokens=False)["input_ids"]:
        # a folder without tokenizer files still loads (transformers makes an empty one of the model's
        # class): every document would become nothing, and the run train on end-of-sequence tokens alone
        raise UserError(f"tokenizer {source!r} has no vocabulary ({len(tokenizer)} token(s): text becomes no "
                        "tokens; no tokenizer.json or vocabulary files?); copy the model's tokenizer files there, "
                        "or set model.tokenizer to a folder or hub id that has them")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_meta_model(hf_config, trust_remote_code: bool = False, what: str = "the model config"):
    """The model's structure with no storage: cheap on every rank. It gets a copy of `hf_config`:
    from_config keeps the object itself, so what the build sets on the model's config (activation
    checkpointing turns the cache off) reached the run's config, which final/ and every checkpoint
    save (config.json said use_cache=false: generation afterwards ran without its cache)."""
    import copy

    from transformers import AutoModelForCausalLM

    try:  # torch's warning about initializing an empty tensor: no tensor is made on the meta device
        with torch.device("meta"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors", category=UserWarning)
            return AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=torch.float32,
                                                    trust_remote_code=trust_remote_code)
    except Exception as exc:  # its modules' own checks: ValueError, ZeroDivisionError, strict-dataclass errors
        raise UserError(f"transformers cannot build {what} ({type(exc).__name__}: {reason(exc)}); "
                        "fix the config (e.g. hidden size a multiple of the attention heads)") from None


def load_source_model(cfg: ModelConfig, hf_config, seed: int):
    """The full weights, in fp32 on CPU. Called on rank 0 only."""
    from transformers import AutoModelForCausalLM

    if cfg.name_or_path is None or cfg.random_init:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                trust_remote_code=cfg.trust_remote_code)
    try:
        return AutoModelForCausalLM.from_pretrained(cfg.name_or_path, config=hf_config, dtype=torch.float32,
                                                    trust_remote_code=cfg.trust_remote_code)
    except (OSError, RuntimeError, ValueError) as exc:
        if not Path(cfg.name_or_path).is_dir():
            raise
        raise UserError(f"the weights of model folder {cfg.name_or_path!r} could not be loaded "
                        f"({type(exc).__name__}: {first_line(exc, 160)}); re-download or re-export the model") from None


def allocate(model, device, params_on_host: bool = False) -> None:
    """Uninitialised storage for the sharded meta `model` on `device`, except its parameters where
    FSDP keeps them in host memory (fsdp.cpu_offload: FSDP2 refuses to start with any of them on
    the device, the root's own included): those are made in host memory and never pass through
    the device. Buffers go to `device` in `place_buffers`, once the parameters are filled."""
    model.to_empty(device=torch.device("cpu") if params_on_host else device)


def place_buffers(model, device) -> None:
    """Buffers (rotary tables, position ids, ...) where the forward computes, whatever the
    parameters' place; a no-op for those already there."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)


def materialize(model, source, device, is_main: bool, params_on_host: bool = False) -> None:
    """Give the sharded meta `model` real storage (`allocate`) and fill it from rank 0's `source`.

    Parameters travel with DCP's broadcast-from-rank-0 (each rank keeps only its shard), on the
    parameters' device (all of the state dict must be on one); buffers (e.g. rotary frequencies,
    not in the state dict) are then placed on `device` and broadcast whole.
    """

    allocate(model, device, params_on_host)
    full = source.state_dict() if is_main else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    place_buffers(model, device)
    source_buffers = dict(source.named_buffers()) if is_main else {}
    for name, buf in model.named_buffers():
        if is_main:
            buf.copy_(source_buffers[name].to(device))
        if dist.get_world_size() > 1:
            dist.broadcast(buf, src=0)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    del full


def count_params(model) -> tuple[int, int]:
    """(total, trainable) parameter counts of the unsharded model."""
    from shardtune.telemetry.flops import values

    total = trainable = 0
    for p in model.parameters():
        n = values(p)  # DTensor.numel() is the global size; QLoRA's packed 4-bit weights count their values
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable
