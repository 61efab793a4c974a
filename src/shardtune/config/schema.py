"""The run configuration's schema: small dataclasses per component. Their end-of-line comments
are the `--help` reference (`reference_lines`). Loading a recipe is `shardtune.config.load`."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Literal


class Section:
    """A part of the run config. A resolved run is frozen (`freeze`): nothing after resolving
    rewrites it; a copy (dataclasses.replace, copy.deepcopy) is a new, unfrozen config."""

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(f"cannot set {type(self).__name__}.{name}: a resolved run is "
                                                  "frozen; resolve another one")
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_frozen"}


def freeze(cfg: RunConfig) -> RunConfig:
    """`cfg` (and every section of it) frozen in place; returned for chaining."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, Section):
            freeze(value)
    object.__setattr__(cfg, "_frozen", True)
    return cfg


@dataclass
class ModelConfig(Section):
    name_or_path: str | None = None  # hub id or local folder; None = random init from `config`
    config: dict = field(default_factory=dict)  # overrides of the model config (or the whole config)
    random_init: bool = False  # build from the config with fresh weights instead of loading them
    tokenizer: str | None = None  # defaults to name_or_path
    trust_remote_code: bool = False  # run the model repository's own code (only if you trust it)
    sharded_load: bool = False  # every rank reads only its own slices of the safetensors (local folder or HF cache; no full copy on rank 0); else rank 0 loads and broadcasts


@dataclass
class DataConfig(Section):
    path: str | None = None  # hub dataset id, local file, or local folder of files
    name: str | None = None  # hub dataset config name (e.g. wikitext-2-raw-v1)
    split: str = "train"  # the split to train on
    val_split: str | None = None  # default: the dataset's own validation split, else carved out
    val_size: float = 0.05  # fraction (<1) or count (>=1) of documents held out when carving
    text_field: str = "text"  # text: the column holding documents (a list column is joined with list_sep)
    seq_len: int = 512  # tokens per packed block; the default cutoff_len of instruct/chat
    start_idx: int | None = None  # slice of the training documents, before packing
    end_idx: int | None = None  # end of that slice (exclusive)
    num_proc: int | None = None  # tokenizer worker processes (default: one, with the tokenizer's own threads)
    format: Literal["text", "instruct", "chat"] = "text"  # text: packed documents; instruct: prompt + response; chat: messages
    template: str | None = None  # columns as text, e.g. "Quote: {quote}\nAuthor: {author}" (text: the document; instruct: the prompt)
    list_sep: str = " "  # joins list-valued columns, e.g. chess moves ["e4","e5"] -> "e4 e5"
    instruction_field: str = "instruction"  # instruct: column with the task
    input_field: str = "input"  # instruct: column with optional context (may be absent)
    output_field: str = "output"  # instruct: column with the response (gets the loss)
    messages_field: str = "messages"  # chat: column with a list of {role, content} messages
    chat_template: str | None = None  # chat: Jinja template to use instead of the tokenizer's own (saved with the model)
    train_on_inputs: bool = False  # instruct/chat: also train on prompt / non-assistant tokens
    cutoff_len: int | None = None  # instruct/chat: longest example in tokens, longer ones truncated (default seq_len)
    packing: bool = False  # instruct/chat: concatenate examples into seq_len blocks instead of padding each
    group_by_length: bool = False  # padded batches: put examples of similar length together (less padding)
    document_mask: bool | None = None  # attention and positions restart per document (default: packed instruct/chat)
    padding_free: bool = False  # unpacked instruct/chat: a micro-batch's examples in one row, no padding

    FORMAT_KEYS: typing.ClassVar[dict] = {  # keys only some formats read (config.validation.unread_data_keys)
        "text_field": ("text",), "template": ("text", "instruct"), "list_sep": ("text", "instruct"),
        "instruction_field": ("instruct",), "input_field": ("instruct",), "output_field": ("instruct",),
        "messages_field": ("chat",), "chat_template": ("chat",), "train_on_inputs": ("instruct", "chat"),
        "cutoff_len": ("instruct", "chat"), "packing": ("instruct", "chat"), "group_by_length": ("instruct", "chat"),
    }

    @property
    def masks_documents(self) -> bool:
        """Whether batches carry restarting positions and a document mask (data.document_mask resolved)."""
        if self.padding_free:
            return True
        if self.document_mask is None:
            return self.format != "text" and self.packing
        return self.document_mask and (self.format == "text" or self.packing)

    @property
    def example_cutoff(self) -> int:
        """instruct/chat: the longest example in tokens."""
        return self.cutoff_len or self.seq_len


@dataclass
class FSDPConfig(Section):
    sharding: Literal["full_shard", "shard_grad_op", "hybrid_shard", "no_shard"] = "full_shard"  # see the FSDP1 map in the README
    wrap: Literal["block", "size"] = "block"  # FSDP units: one per decoder block, or by parameter count
    min_num_params: int = 100_000_000  # wrap="size": a unit per subtree with at least this many
    block_class: str | None = None  # override the detected decoder-block class name
    replicate_size: int | None = None  # hybrid_shard: number of replicas (default: nodes)
    shard_size: int | None = None  # hybrid_shard: ranks per shard group (default: ranks per node)
    cpu_offload: bool = False  # keep sharded parameters, gradients and optimizer state in host memory
    forward_prefetch: int = 0  # explicitly prefetch the next N blocks' all-gather in forward
    backward_prefetch: int = 1  # ... in backward (1 = FSDP2's default implicit prefetch)
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # dtype gradients are reduce-scattered/all-reduced in; bf16 halves the traffic (needs precision=bf16)


@dataclass
class TrainConfig(Section):
    micro_batch_size: int | Literal["auto"] = 8  # sequences per rank per forward/backward; auto: the planner's largest that fits
    global_batch_size: int = 32  # sequences per optimizer step, over all ranks
    lr: float = 3e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine/linear decay ends at lr * min_lr_ratio
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"  # decay after warmup
    warmup_steps: int = 0  # linear warmup from lr/warmup_steps to lr
    weight_decay: float = 0.0  # AdamW decay of matrices (never of biases, norms and scaling vectors)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    optimizer_state: Literal["fp32", "bf16", "8bit", "4bit"] = "fp32"  # AdamW moment precision: 8, 4, ~2 or ~1 bytes per parameter (bf16/8bit/4bit: torchao's optimizers)
    max_grad_norm: float = 1.0  # 0 disables clipping
    max_steps: int = 0  # > 0 wins over epochs
    epochs: float = 1.0  # used when max_steps is 0; fractions allowed
    seed: int = 42  # weights init, data order, LoRA init, dropout


@dataclass
class EvalConfig(Section):
    every_steps: int = 0  # 0: only before and after training
    max_batches: int = 0  # evaluate the first N x micro_batch_size sequences (any world size); 0: all
    micro_batch_size: int | None = None  # default: train.micro_batch_size
    at_start: bool = True  # evaluate before the first step (the baseline)


@dataclass
class LogConfig(Section):
    every_steps: int = 10  # a metrics.jsonl record (and tracker point) every N optimizer steps
    progress: bool = True  # progress bar on rank 0
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=list)  # beside metrics.jsonl
    project: str = "shardtune"  # W&B project / MLflow experiment
    peak_tflops: float | None = None  # device peak for MFU (default: table of common GPUs by name)
    live_memory: int = 0  # track the peak bytes of live tensors over the first N steps (MemTracker; those steps run slower)
    profile_steps: list[int] | None = None  # [first, last]: torch.profiler trace of those optimizer steps into OUT/profile/ (Chrome trace + operator table)
    watch: Literal["none", "gradients", "parameters", "all"] = "none"  # per-block gradient and/or parameter norms every log.watch_every steps, and histograms in TensorBoard and W&B (MLflow takes none)
    watch_every: int = 100  # optimizer steps between two log.watch records


@dataclass
class PeftConfig(Section):
    method: Literal["none", "lora", "dora", "ia3", "prefix_tuning", "prompt_tuning", "adaption_prompt"] = "none"  # parameter-efficient method (peft), base frozen: lora, dora (weight-decomposed LoRA), ia3 (learned scales), prefix_tuning, prompt_tuning, adaption_prompt (LLaMA-Adapter)
    r: int = 8  # lora/dora: rank
    alpha: int = 16  # lora/dora: scaling numerator (scale = alpha / r; alpha / sqrt(r) with rslora)
    dropout: float = 0.05  # lora/dora: dropout on the adapter input
    target_modules: list[str] | None = None  # lora/dora/ia3: layers to adapt, or [all-linear] (all but the head); default per model type (README Architectures)
    rslora: bool = False  # lora/dora: rank-stabilised scaling alpha / sqrt(r)
    init: Literal["default", "gaussian", "pissa", "olora"] = "default"  # lora/dora: adapter init; pissa (SVD) and olora (QR) start from the base weights, which keep the residual
    lora_plus_ratio: float = 0.0  # lora/dora: LoRA+, the B matrices learn at this multiple of train.lr (e.g. 16); 0: off
    feedforward_modules: list[str] | None = None  # ia3: targets whose input is scaled (the MLP's); default per model type
    num_virtual_tokens: int | None = None  # prefix_tuning/prompt_tuning: learned virtual tokens (default 20)
    prompt_init_text: str | None = None  # prompt_tuning: start the virtual tokens from this text's embeddings (default random)
    adapter_len: int | None = None  # adaption_prompt: adaption tokens per layer (default 10)
    adapter_layers: int | None = None  # adaption_prompt: top N decoder layers adapted (default all)
    quantize: Literal["none", "4bit"] = "none"  # lora/dora, 4bit: QLoRA on an NF4 base (CUDA + bitsandbytes)

    # the methods that take each method-specific key; a key set (away from its default) for another is refused
    METHOD_KEYS: typing.ClassVar[dict] = {
        "r": ("lora", "dora"), "alpha": ("lora", "dora"), "dropout": ("lora", "dora"),
        "target_modules": ("lora", "dora", "ia3"), "rslora": ("lora", "dora"), "init": ("lora", "dora"),
        "lora_plus_ratio": ("lora", "dora"), "feedforward_modules": ("ia3",),
        "num_virtual_tokens": ("prefix_tuning", "prompt_tuning"), "prompt_init_text": ("prompt_tuning",),
        "adapter_len": ("adaption_prompt",), "adapter_layers": ("adaption_prompt",),
        "quantize": ("lora", "dora"),
    }
    DEFAULT_VIRTUAL_TOKENS: typing.ClassVar[int] = 20
    DEFAULT_ADAPTER_LEN: typing.ClassVar[int] = 10

    @property
    def adapter(self) -> bool:
        """Any peft method: the run trains (and final/ holds) a peft adapter over a frozen base."""
        return self.method != "none"

    @property
    def mergeable(self) -> bool:
        """Methods whose adapter folds into the base weights (`export --merge`)."""
        return self.method in ("lora", "dora", "ia3")

    @property
    def residual_init(self) -> bool:
        """PiSSA/OLoRA: the adapter starts from the base weights, which keep only the residual."""
        return self.low_rank and self.init in ("pissa", "olora")

    @property
    def low_rank(self) -> bool:
        """LoRA or DoRA: low-rank matrices beside the base layers (mergeable, LoRA's keys)."""
        return self.method in ("lora", "dora")

    @property
    def virtual_tokens(self) -> int:
        """Learned tokens a prompt-learning method puts before every sequence (0: other methods)."""
        if self.method in ("prefix_tuning", "prompt_tuning"):
            return self.num_virtual_tokens or self.DEFAULT_VIRTUAL_TOKENS
        return 0


@dataclass
class FreezeConfig(Section):
    trainable_blocks: int | None = None  # train only the top N decoder blocks (and the final norm)
    head_only: bool = False  # train only the output head (its weight and bias)
    embeddings: bool = False  # freeze the input (and position) embeddings


@dataclass
class CheckpointConfig(Section):
    every_steps: int = 0  # save a sharded checkpoint every N optimizer steps (0: never)
    at_epoch_end: bool = False  # also save when an epoch of the training data ends
    keep_last: int = 2  # complete checkpoints kept in output_dir/checkpoints (0: keep all)
    async_save: bool = False  # YAML key `async` works too: train on while the files are written
    sharded_final: bool = False  # final/ written by every rank (its own rows, in place, in HF's layout; no full copy on any rank); output_dir must be shared by all nodes
    hf_format: bool = False  # each checkpoint's model as HF safetensors in its folder (from_pretrained loads checkpoints/step-N; written by every rank); the optimizer stays in DCP beside it

    KEY_ALIASES: typing.ClassVar[dict] = {"async": "async_save"}  # `async` is a Python keyword


@dataclass
class PublishConfig(Section):
    hub_repo: str | None = None  # upload to this Hub model repo (namespace/name) while training; token from HF_TOKEN or `hf auth login`
    private: bool = True  # create the repo private (an existing repo keeps its visibility)
    revision: str = "main"  # the branch uploads go to (created from main if missing)
    checkpoints: bool = True  # also upload each checkpoint, exported, to checkpoints/step-N/ (false: the final model only)
    required: bool = True  # false: a missing token is a warning and the run trains without publishing
    wandb_artifacts: Literal["none", "reference", "upload"] = "none"  # with log.trackers=[wandb]: log checkpoints and the final model as artifacts, by reference to the local files or uploaded
    retries: int = 3  # attempts per upload before it is given up (with one warning line)
    wait_s: float = 1800  # at the end, wait at most this long for uploads still in flight


@dataclass
class RunConfig(Section):
    output_dir: str | None = None  # default runs/<recipe>-<time>
    save_final: bool = True  # write final/ (a plain HF folder) at the end; sweep trials turn it off
    precision: Literal["bf16", "fp16", "fp32"] = "fp32"  # compute dtype; master weights and reductions stay fp32
    float8: Literal["none", "rowwise", "tensorwise"] = "none"  # decoder-block linears in float8 (torchao; needs precision=bf16 and a GPU of compute capability 8.9+); rowwise: a scale per row; tensorwise: a scale per tensor, weights gathered in float8
    activation_checkpointing: Literal["none", "full", "selective", "every_n", "auto"] = "none"  # recompute in backward: full = every block; selective = keep matmul outputs, recompute the rest; every_n = every n-th block (true/false = full/none); auto: the planner's fastest that fits (with train.micro_batch_size=auto: the fastest pair)
    activation_checkpointing_every: int = 2  # every_n: checkpoint blocks 0, n, 2n, ...
    activation_offload: bool = False  # move saved activations to pinned host memory in forward, back in backward (CUDA; CPU: same hooks, no move)
    compile: bool | Literal["auto"] = "auto"  # torch.compile each decoder block before sharding; auto: on CUDA (1.34x eager on an H200), off on CPU, with activation_offload and with QLoRA
    kernels: Literal["none", "liger"] = "none"  # liger: Liger-Kernel's fused RMSNorm, rotary, SwiGLU and linear cross-entropy (the head loss) for its model families (CUDA; pip install 'shardtune[liger]')
    loss_chunk_tokens: int | None = None  # LM head + loss in chunks of N tokens (no full logits); default ~24 MB CPU, 64 MB CUDA; 0: off
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when present, else CPU (gloo)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    resume: str | None = None  # auto: newest checkpoint in output_dir; or a checkpoint/run folder
    on_nan: Literal["stop", "skip"] = "stop"  # non-finite loss: stop, or skip that step's update
    recipe: str | None = None  # name of the recipe the run came from (set by the loader)

    # values written by earlier versions (recipes, run folders, checkpoints' saved config) that still load
    VALUE_ALIASES: typing.ClassVar[dict] = {"activation_checkpointing": {True: "full", False: "none"}}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# the keys whose value names a file or folder here (or a Hub id): a leading `~` is the user's home,
# as in a shell, however the value arrived (a recipe, a dotted override the shell left alone, a saved config)
PATH_KEYS = frozenset({"output_dir", "resume", "model.name_or_path", "model.tokenizer", "data.path"})


def known_fields(cls, values: dict):
    """A config section (dataclass `cls`) from a saved one (a checkpoint's): keys of other versions
    dropped, keys added since at their defaults."""
    return cls(**{k: v for k, v in values.items() if k in cls.__dataclass_fields__})


def config_keys(cls=None, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, walked from the dataclasses (`recipe` is the loader's)."""
    cls = cls or RunConfig
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += config_keys(hints[f.name], prefix + f.name + ".")
        elif f.name != "recipe":
            keys.append(prefix + f.name)
    return keys


def key_type(key: str):
    """The declared type of a dotted config key (`train.lr` -> float), or None for no such key."""
    cls = RunConfig
    *path, last = key.split(".")
    for part in path:
        cls = typing.get_type_hints(cls).get(part) if dataclasses.is_dataclass(cls) else None
        if cls is None:
            return None
    hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    tp = hints.get(last)
    return None if tp is None or dataclasses.is_dataclass(tp) or last == "recipe" else tp


def number_types(tp) -> set[type]:
    """The kinds of number (int, float) a key of type `tp` takes: none for text, choices, lists."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return {a for a in args if a in (int, float)}


@functools.cache  # parsing the source takes ~0.1 s, and every command's parser shows it
def reference_lines() -> tuple[str, ...]:
    """`section.key (type = default)  comment` for every key, read from the dataclasses above."""
    import inspect
    import re

    lines = []

    def walk(cls, prefix: str) -> None:
        comments = {}
        for line in inspect.getsource(cls).splitlines():
            m = re.match(r"\s+(\w+):.*?#\s*(.*)$", line)
            if m:
                comments[m.group(1)] = m.group(2)
        for f in dataclasses.fields(cls):
            if f.name == "recipe":
                continue
            sub = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(sub):
                walk(sub, prefix + f.name + ".")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            type_name = str(f.type).replace("typing.", "").replace("Literal", "one of ")
            text = f"  {prefix}{f.name} ({type_name} = {default!r})"
            lines.append(text + (f"  {comments[f.name]}" if f.name in comments else ""))

    walk(RunConfig, "")
    return tuple(lines)
