"""What pretrain_gpt_sp.py does with every other option of Megatron-LM's training parser.

megatron_arguments.json (written by tools/extract_megatron_options.py from Megatron-LM's real parser)
lists Megatron-LM's options: flags, default, type, choices, nargs, switch or value, --help group. An
option our parser implements is ours (arguments.py, config.py); megatron_flags.py's NO_EFFECT and
REFUSED tables name some more; every other option gets its treatment here, by the first rule that
matches its first flag (an exact flag, a prefix ending in "-", or "@group title"):

    Refuse(feature)          refused in one sentence naming the missing feature
    Ignore(reason, only)     parsed and ignored with the reason; with `only`, other values are refused

megatron_flags.py turns these into its NO_EFFECT / REFUSED entries, so the parser, the refusals and
docs/megatron_flags.md's table read one list. tests/test_megatron_flag_sets.py checks that every
option of the JSON is covered.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
OPTIONS = os.path.join(HERE, "megatron_arguments.json")


@dataclass(frozen=True)
class Refuse:
    feature: str


@dataclass(frozen=True)
class Ignore:
    reason: str
    only: Optional[str] = None  # the one value accepted (as the command line spells it)


_MOE = "this mixture-of-experts option is not implemented in megatron_sp (docs/models.md lists the MoE flags it takes)"
_EP_TIMING = Ignore(
    "timing only: a communication overlap, stream or kernel choice of Megatron-LM's expert parallelism; the same "
    "function runs here"
)
_FP8 = Refuse("FP8 / FP4 training needs Transformer Engine, which megatron_sp does not use; train in --bf16")
_KERNELS = Ignore("GPU kernel-fusion switch: the fused ops are chosen by megatron_sp (--no-fused-kernels)")
_TP_UB = Ignore("Transformer Engine userbuffers knob: --tp-comm-overlap overlaps the ring steps itself")
_P2P = Ignore("timing only: torch.distributed.pipelining posts its sends and receives asynchronously")
_WGRAD = Ignore("timing only: weight gradients are computed in the backward (zero-bubble schedules split them)")
_CKPT_IO = Ignore("checkpoint I/O knob: every rank writes and reads its own shards of one DCP checkpoint")
_NCCL = Ignore("NCCL tuning knob: communicators use NCCL's defaults")
_BUCKETS = Ignore("timing only: gradients are reduced per parameter group's buffer (distributed/grad_buffers.py)")
_FP32_GRADS = Ignore("gradients are accumulated and reduced in fp32 unless --grad-reduce-in-bf16")
_INFERENCE = Ignore("inference engine knob: this program trains (tools/generate.py decodes)")
_ATTN_VARIANT = Refuse(
    "experimental attention variants (gated delta net, DeepSeek sparse attention, linear attention) are not implemented"
)
_HYBRID = Refuse("hybrid Mamba / state-space models are not implemented")
_OFFLOAD = Refuse("activation offloading to CPU memory is not implemented; use --recompute-granularity")
_OPT_OFFLOAD = Refuse(
    "optimizer offloading to CPU memory is not implemented; shard the state with --use-distributed-optimizer "
    "or --use-torch-fsdp2"
)
_RERUN = Ignore("the rerun state machine is not implemented: a NaN loss or gradient norm stops the run")
_SIGNALS = Ignore("SIGTERM, SIGUSR1 and SIGINT always stop every rank at one iteration, after a save")
_OTHER_OPT = Ignore("a knob of --optimizer sgd / muon / lion, which are refused (AdamW here)")
_OTHER_TOKENIZER = Ignore(
    "a knob of tokenizer types this program does not have (HuggingFaceTokenizer reads tokenizer.json)"
)
_PER_SPLIT = Refuse("per-split data paths are not implemented; give --data-path with --split")
_ENC_DEC = Refuse("encoder-decoder models are not implemented; a GPT's depth is --num-layers")
_DEBUG_DUMP = Refuse("dumping tensors at an interval for debugging is not implemented")
_MEMORY_LOG = Ignore("--log-memory-to-tensorboard logs device memory at every logged step")
_PROFILER = Ignore("--profile's trace records the PyTorch profiler's defaults")
_REMOVED = "Megatron-LM removed it too"

RULES = (
    # ---- transformer configuration ----
    (
        "--tensor-parallel-num-weight-shards",
        Refuse("several weight shards per tensor-parallel rank are not implemented"),
    ),
    (
        "--expert-tensor-parallel-num-weight-shards",
        Refuse("several weight shards per expert-tensor-parallel rank are not implemented"),
    ),
    ("--pipeline-model-parallel-comm-backend", Ignore("pipeline sends use the world's backend", "nccl")),
    (
        "--max-seqlen-per-dp-cp-rank",
        Refuse("hybrid (dynamic) context parallelism over packed variable-length sequences is not implemented"),
    ),
    (
        "--hybrid-context-parallel",
        Refuse("hybrid (dynamic) context parallelism over packed variable-length sequences is not implemented"),
    ),
    ("--no-initialization", Ignore("weights are always initialised (each rank draws only its shard)")),
    ("--no-tp-comm-", _TP_UB),
    ("--tp-comm-overlap-rs-dgrad", _TP_UB),
    ("--tp-comm-bootstrap-backend", _TP_UB),
    ("--tp-comm-overlap-cfg", _TP_UB),
    ("--overlap-moe-expert-parallel-comm", _EP_TIMING),
    ("--overlap-dispatch-backward-with-experts-wgrad", _EP_TIMING),
    ("--ep-overlap-early-attn-memory-release", _EP_TIMING),
    ("--use-grouped-gemm-for-shared-expert", _EP_TIMING),
    ("--high-priority-a2a-comm-stream", _EP_TIMING),
    ("--save-tokens-per-expert-interval", _DEBUG_DUMP),
    ("--delay-wgrad-compute", _WGRAD),
    ("--defer-embedding-wgrad-compute", _WGRAD),
    ("--wgrad-deferral-limit", _WGRAD),
    ("--use-ring-exchange-p2p", _P2P),
    ("--overlap-p2p-communication-warmup-flush", _P2P),
    ("--no-overlap-p2p-communication", _P2P),
    ("--mtp-", Refuse("multi-token prediction (MTP) is not implemented")),
    ("--cpu-offloading-", _OFFLOAD),
    ("--fine-grained-activation-offloading", _OFFLOAD),
    ("--fine-grained-offloading-max-inflight-offloads", _OFFLOAD),
    ("--offload-modules", _OFFLOAD),
    ("--min-offloaded-tensor-size", _OFFLOAD),
    ("--delay-offload-until-cuda-graph", _OFFLOAD),
    ("--delta-offload-bytes-across-pp-ranks", _OFFLOAD),
    ("--activation-offload-fraction", _OFFLOAD),
    ("--flash-attention-version", Ignore("attention kernels are chosen per call (models/attention.py)")),
    (
        "--apply-residual-connection-post-layernorm",
        Refuse("the residual taken after the layer norm (post-LN residual) is not implemented"),
    ),
    ("--rotary-interleaved", Refuse("interleaved RoPE (rotating adjacent pairs instead of halves) is not implemented")),
    ("--qk-l2-norm", Refuse("L2-normalised queries and keys are not implemented (--qk-layernorm is)")),
    ("--qk-clip", Refuse("QK-clip (clipping the attention logits through the weights) is not implemented")),
    ("--qk-clip-", Refuse("QK-clip (clipping the attention logits through the weights) is not implemented")),
    ("--attention-output-gate", Refuse("the gated attention output is not implemented")),
    ("--experimental-attention-variant", _ATTN_VARIANT),
    ("--dsa-", _ATTN_VARIANT),
    ("--no-dsa-", _ATTN_VARIANT),
    ("--linear-", _ATTN_VARIANT),
    ("--use-mup", Refuse("muP (width-scaled initialisation, learning rates and logits) is not implemented")),
    ("--mup-", Refuse("muP (width-scaled initialisation, learning rates and logits) is not implemented")),
    ("--use-fused-weighted-squared-relu", Refuse("the weighted squared-ReLU MLP is not implemented")),
    ("--fused-residual-rmsnorm", _KERNELS),
    ("--use-transformer-engine-op-fuser", _KERNELS),
    ("--use-te-activation-func", _KERNELS),
    ("--use-grouped-gemm-for-dense-mlp", _KERNELS),
    ("--no-gradient-reduce-div-fusion", _KERNELS),
    ("--distribute-saved-activations", Ignore("memory only: with --sequence-parallel saved activations are split")),
    (
        "--recompute-modules",
        Refuse("choosing the recomputed modules is not implemented: selective recomputation is the attention core"),
    ),
    ("--no-fp8-wgrad", _FP8),
    ("--first-last-layers-bf16", _FP8),
    ("--num-layers-at-start-in-bf16", _FP8),
    ("--num-layers-at-end-in-bf16", _FP8),
    ("--fp4-", _FP8),
    ("--te-precision-config-file", _FP8),
    ("--keep-fp8-transpose-cache", _FP8),
    ("--reuse-grad-buf-for-mxfp8-param-ag", _FP8),
    ("--use-kitchen-attention", Refuse("NVIDIA Kitchen quantisation is not implemented")),
    ("--kitchen-attention-backend", Refuse("NVIDIA Kitchen quantisation is not implemented")),
    ("--gtp-", Refuse("generalized tensor parallelism with weight rematerialisation (GTP) is not implemented")),
    ("--enable-cuda-graph", Ignore("CUDA graphs are not captured (timing only); --torch-compile compiles layers")),
    ("--cuda-graph-", Ignore("CUDA graphs are not captured (timing only); --torch-compile compiles layers")),
    ("--external-cuda-graph", Ignore("CUDA graphs are not captured (timing only); --torch-compile compiles layers")),
    ("--optimizer-cuda-graph", Ignore("CUDA graphs are not captured (timing only)")),
    ("--enable-mhc-connections", Refuse("manifold-constrained hyper-connections (mHC) are not implemented")),
    ("--mhc-", Refuse("manifold-constrained hyper-connections (mHC) are not implemented")),
    ("--no-clone-scatter-output-in-embedding", Ignore("memory only: the embedding's output is ours")),
    ("--config-logger-dir", Ignore("the start-up report logs the run's configuration")),
    ("--flash-decode", _INFERENCE),
    ("--nccl-all-reduce-for-prefill", _INFERENCE),
    ("--symmetric-ar-type", _INFERENCE),
    ("--mlp-chunks-for-prefill", _INFERENCE),
    ("--inference-", _INFERENCE),
    ("--batch-invariant-", Refuse("batch-invariant kernels are not implemented (--deterministic-mode repeats runs)")),
    ("--mrope-section", Refuse("multimodal RoPE (mRoPE) is not implemented")),
    ("--is-hybrid-model", _HYBRID),
    ("--mamba-", _HYBRID),
    ("--gdp-", _HYBRID),
    ("--disable-mamba-mem-eff-path", _HYBRID),
    ("--hybrid-layer-pattern", _HYBRID),
    ("--hybrid-override-pattern", _HYBRID),
    ("--mlp-chunks-for-training", Ignore("the MLP runs in one chunk, Megatron's default", "1")),
    # ---- network size ----
    ("--encoder-num-layers", _ENC_DEC),
    ("--decoder-num-layers", _ENC_DEC),
    ("--encoder-seq-length", _ENC_DEC),
    ("--decoder-seq-length", _ENC_DEC),
    ("--relative-attention-", Refuse("T5's relative position buckets are not implemented")),
    ("--no-rope-freq", Refuse("layers without RoPE (NoPE layers) are not implemented")),
    ("--onnx-safe", Ignore("ONNX export is not part of this program")),
    ("--bert-no-binary-head", Ignore("BERT's; this program trains GPT models")),
    # ---- regularization and optimizers ----
    ("--apply-wd-to-qk-layernorm", Refuse("weight decay on the query/key norm weights is not implemented")),
    ("--no-weight-decay-cond-type", Refuse("weight decay on the query/key norm weights is not implemented")),
    ("--sgd-momentum", _OTHER_OPT),
    ("--muon-", _OTHER_OPT),
    ("--lion-", _OTHER_OPT),
    ("--use-precision-aware-optimizer", Ignore("main weights, gradients and AdamW moments are fp32")),
    ("--main-grads-dtype", Ignore("gradients are accumulated in fp32", "fp32")),
    ("--main-params-dtype", Ignore("the main weights are fp32", "fp32")),
    ("--exp-avg-dtype", Ignore("AdamW's moments are fp32", "fp32")),
    ("--exp-avg-sq-dtype", Ignore("AdamW's moments are fp32", "fp32")),
    # ---- profiling and logging ----
    ("--pytorch-profiler-", _PROFILER),
    ("--record-shapes", _PROFILER),
    ("--nvtx-ranges", _PROFILER),
    ("--record-memory-history", _MEMORY_LOG),
    ("--memory-snapshot-path", _MEMORY_LOG),
    ("--log-memory-interval", _MEMORY_LOG),
    ("--log-device-memory-used", _MEMORY_LOG),
    ("--log-progress", Ignore("progress is in every log line")),
    ("--timing-log-option", Ignore("the step's timers are rank 0's")),
    ("--no-barrier-with-level-1-timing", Ignore("timing only")),
    ("--log-max-attention-logit", Ignore("the attention logits are not logged")),
    ("--log-energy", Ignore("energy is not measured")),
    # ---- training ----
    ("--decrease-batch-size-if-needed", Refuse("shrinking the batch to fit a smaller world is not implemented")),
    (
        "--check-weight-hash-across-dp-replicas-interval",
        Refuse("the weight-hash check across data-parallel replicas is not implemented"),
    ),
    ("--gpu-sniff-test-interval", Ignore("no GPU health probes: a failing rank stops the job by the timeout")),
    ("--train-sync-interval", Ignore("timing only (how often the host waits for the device)")),
    ("--exit-signal", _SIGNALS),
    ("--exit-signal-handler-for-dataloader", _SIGNALS),
    ("--exit-signal-handler-for-training", _SIGNALS),
    ("--no-manual-gc-eval", Ignore("garbage-collection timing only")),
    ("--iterations-to-skip", Refuse("skipping the batches of given iterations is not implemented")),
    ("--batch-size", Refuse(f"use --micro-batch-size ({_REMOVED})")),
    ("--check-for-large-grads", Refuse("the rerun state machine's gradient checks are not implemented")),
    ("--result-rejected-tracker-filename", _RERUN),
    ("--checkpoint-activations", Refuse(f"use --recompute-granularity full ({_REMOVED})")),
    ("--optimizer-cpu-offload", _OPT_OFFLOAD),
    ("--optimizer-offload-fraction", _OPT_OFFLOAD),
    ("--use-torch-optimizer-for-cpu-offload", _OPT_OFFLOAD),
    ("--overlap-cpu-optimizer-d2h-h2d", _OPT_OFFLOAD),
    ("--no-pin-cpu-", _OPT_OFFLOAD),
    ("--dump-param-to-param-group-map", Ignore("a debugging dump, not written")),
    ("--te-rng-tracker", Ignore("random numbers are Philox functions of global positions, with no tracker")),
    ("--inference-rng-tracker", Ignore("random numbers are Philox functions of global positions, with no tracker")),
    (
        "--data-parallel-random-init",
        Refuse("other initial weights per data-parallel replica are not implemented (any layout initialises alike)"),
    ),
    ("--warmup", Refuse(f"use --lr-warmup-iters or --lr-warmup-fraction ({_REMOVED})")),
    ("--freeze-all-layers", Refuse("freezing parameters is not implemented")),
    # ---- checkpointing ----
    ("--save-params-interval", _DEBUG_DUMP),
    ("--save-activations-interval", _DEBUG_DUMP),
    ("--save-wgrads-interval", _DEBUG_DUMP),
    ("--save-dgrads-interval", _DEBUG_DUMP),
    ("--load-main-params-from-ckpt", Ignore("the fp32 main weights are always loaded (checkpoints store them)")),
    ("--non-persistent-", Refuse("non-persistent (local or in-memory) checkpoints are not implemented")),
    ("--pretrained-checkpoint", Refuse("--pretrained-checkpoint is not implemented; use --load DIR --finetune")),
    ("--ckpt-step", Refuse("loading a chosen iteration is not implemented: --load reads the latest one")),
    (
        "--use-checkpoint-args",
        Refuse("reading the model flags from the checkpoint is not implemented; pass them (a resume checks them)"),
    ),
    (
        "--use-mp-args-from-checkpoint-args",
        Refuse("reading the parallel sizes from the checkpoint is not implemented; checkpoints load at any layout"),
    ),
    ("--no-use-tokenizer-model-from-checkpoint-args", Ignore("checkpoints hold no tokenizer")),
    ("--no-save-tokenizer-assets", Ignore("checkpoints hold no tokenizer")),
    (
        "--ckpt-convert-",
        Refuse("converting checkpoints while training is not implemented; use tools/convert_checkpoint.py"),
    ),
    ("--async-strategy", Ignore("--async-save writes in a background thread of its own")),
    ("--async-ckpt-", Ignore("--async-save writes in a background thread of its own")),
    ("--ckpt-fully-parallel-", _CKPT_IO),
    ("--ckpt-pg-tensors-cache-", _CKPT_IO),
    ("--dist-ckpt-workers", _CKPT_IO),
    ("--dist-ckpt-format", _CKPT_IO),
    ("--ckpt-drop-redundant-extra-state", _CKPT_IO),
    ("--distrib-optim-fully-reshardable-mem-efficient", _CKPT_IO),
    ("--dist-ckpt-save-pre-mcore-014", _CKPT_IO),
    (
        "--no-ckpt-load-validate-sharding-integrity",
        Ignore("a load always checks every file against the checkpoint's integrity record"),
    ),
    ("--verify-integrity", Ignore("a load always checks every file's sha256 against the checkpoint's record")),
    ("--replication", Refuse("replicated local checkpoints are not implemented")),
    ("--replication-", Refuse("replicated local checkpoints are not implemented")),
    ("--override-ckpt-iteration", Refuse("overriding the loaded checkpoint's iteration is not implemented")),
    # ---- mixed precision ----
    ("--fp16-lm-cross-entropy", Ignore("the loss is always computed in fp32")),
    ("--output-logit-dtype", Ignore("the logits of the loss are fp32", "fp32")),
    ("--mamba-training-ssm-states-dtype", _HYBRID),
    # ---- distributed ----
    ("--no-align-grad-reduce", _BUCKETS),
    ("--no-align-param-gather", _BUCKETS),
    ("--ddp-num-buckets", _BUCKETS),
    ("--ddp-bucket-size", _BUCKETS),
    ("--ddp-pad-buckets-for-high-nccl-busbw", _BUCKETS),
    ("--ddp-reduce-scatter-with-fp32-accumulation", _FP32_GRADS),
    ("--ddp-param-name-patterns-for-fp32-local-accumulation", _FP32_GRADS),
    (
        "--ddp-average-in-collective",
        Ignore("the data-parallel mean is the same divided before or inside the collective (rounding order only)"),
    ),
    ("--overlap-param-gather-with-optimizer-step", Ignore("timing only, as --overlap-param-gather here")),
    ("--no-use-layer-wise-param-layout", Ignore("the distributed optimizer gives whole parameters to one owner")),
    ("--local-rank", Ignore("torchrun's LOCAL_RANK is read from the environment")),
    ("--lazy-mpu-init", Ignore("the process groups are always built at start-up")),
    ("--nccl-communicator-config-path", _NCCL),
    ("--use-sharp", _NCCL),
    ("--sharp-enabled-group", _NCCL),
    ("--high-priority-stream-groups", _NCCL),
    ("--disable-symmetric-registration", _NCCL),
    ("--create-all-gather-group", _NCCL),
    ("--suggested-communication-unit-size", _NCCL),
    (
        "--use-tp-pp-dp-mapping",
        Refuse("the tp-pp-dp rank order is not implemented (ranks are ordered tp-cp-dp-pp, Megatron's default)"),
    ),
    ("--disable-gloo-process-groups", Ignore("no gloo side groups are built beside NCCL")),
    (
        "--distributed-timeout-seconds-after-init",
        Ignore("one timeout from start to end: --distributed-timeout-minutes"),
    ),
    ("--flight-recorder-", Ignore("the NCCL flight recorder is not configured here")),
    ("--no-flight-recorder-", Ignore("the NCCL flight recorder is not configured here")),
    ("--disable-jit-fuser", Ignore("no TorchScript fuser is used")),
    ("--model-parallel-size", Refuse(f"use --tensor-model-parallel-size ({_REMOVED})")),
    (
        "--num-distributed-optimizer-instances",
        Ignore("several distributed-optimizer instances (sharding over part of the DP group) are not implemented", "1"),
    ),
    ("--fake-process-group", Refuse("fake process groups (one-process benchmarks) are not implemented")),
    # ---- validation ----
    ("--start-eval-at-iter", Refuse("delaying the first evaluation is not implemented")),
    (
        "--eval-global-batch-size",
        Refuse(
            "an evaluation batch other than the training one is not implemented (evaluation runs --eval-iters of them)"
        ),
    ),
    (
        "--eval-micro-batch-size",
        Refuse(
            "an evaluation batch other than the training one is not implemented (evaluation runs --eval-iters of them)"
        ),
    ),
    ("--skip-train", Refuse("evaluation-only runs (--skip-train) are not implemented")),
    ("--full-validation", Refuse("full or several validation sets are not implemented (the valid split is read)")),
    (
        "--multiple-validation-sets",
        Refuse("full or several validation sets are not implemented (the valid split is read)"),
    ),
    ("--validation-set-names", Refuse("full or several validation sets are not implemented (the valid split is read)")),
    # ---- data and tokenizer ----
    ("--phase-transition-iterations", Refuse("data phase transitions are not implemented")),
    ("--train-data-path", _PER_SPLIT),
    ("--valid-data-path", _PER_SPLIT),
    ("--test-data-path", _PER_SPLIT),
    ("--data-args-path", _PER_SPLIT),
    ("--per-split-data-args-path", _PER_SPLIT),
    ("--per-dataset-sequences-path", _PER_SPLIT),
    ("--dataloader-fast-cache-load", Ignore("data-loader knob: samples are read from memory-mapped files")),
    ("--dataloader-defer-npy-index-mmap", Ignore("data-loader knob: samples are read from memory-mapped files")),
    ("--object-storage-cache-path", Ignore("data is read from local or mounted paths")),
    ("--mid-level-dataset-surplus", Ignore("megatron-core's blended dataset sizes its parts itself")),
    ("--sample-rate", Ignore("BERT/T5 data knob: GPT samples are contiguous token windows")),
    ("--mask-prob", Ignore("BERT/T5 data knob: GPT samples are contiguous token windows")),
    ("--short-seq-prob", Ignore("BERT/T5 data knob: GPT samples are contiguous token windows")),
    (
        "--dataloader-inter-document-masking",
        Refuse("this document masking is not implemented; use --reset-attention-mask"),
    ),
    ("--allow-ambiguous-pad-tokens", Ignore("no pad tokens are read: samples are full windows")),
    ("--fim-", Refuse("fill-in-the-middle data is not implemented")),
    (
        "--padded-vocab-size",
        Refuse("a given padded vocabulary is not implemented (padded to a multiple of 128 x TP, as Megatron pads)"),
    ),
    ("--no-pad-vocab-size", Refuse("an unpadded vocabulary is not implemented")),
    ("--vocab-extra-ids", Refuse("extra sentinel tokens (T5's) are not implemented")),
    ("--null-tokenizer-pad-id", Ignore("no pad tokens are read: samples are full windows")),
    ("--tokenizer-", _OTHER_TOKENIZER),
    ("--no-tokenizer-", _OTHER_TOKENIZER),
    ("--tiktoken-num-special-tokens", _OTHER_TOKENIZER),
    ("--trust-remote-code", _OTHER_TOKENIZER),
    ("--chat-template", _OTHER_TOKENIZER),
    ("--use-gigatoken", _OTHER_TOKENIZER),
    # ---- experimental ----
    ("--enable-experimental", Ignore("there are no experimental code paths to enable")),
    ("--spec", Refuse("Megatron's module specs are not read; write a megatron_sp block spec (docs/models.md)")),
    ("--yaml-cfg", Refuse("YAML configuration files are not read; pass the flags")),
    # ---- rerun engine ----
    ("--rerun-mode", _RERUN),
    ("--check-for-spiky-loss", _RERUN),
    ("--error-injection-rate", Ignore("the rerun state machine's error injection is not implemented", "0")),
    ("--error-injection-type", _RERUN),
    # ---- whole groups ----
    ("@inference", _INFERENCE),
    ("@rl", Refuse("reinforcement learning (GRPO) is not implemented")),
    ("@biencoder", Refuse("the ICT / biencoder retriever is not implemented")),
    ("@vision", Refuse("vision models are not implemented")),
    ("@Logits Distillation", Refuse("logit distillation is not implemented")),
    ("@sft", Refuse("supervised fine-tuning data formats are not implemented")),
    ("@mla", Refuse("multi-latent attention (DeepSeek's MLA) is not implemented")),
    ("@heterogeneous architecture", Refuse("heterogeneous (per-layer) architectures are not implemented")),
    ("@experimental_attention_variant", _ATTN_VARIANT),
    (
        "@In-process restart",
        Refuse("in-process restart (nvidia-resiliency-ext) is not implemented; the launch/ templates requeue the job"),
    ),
    ("@fault injector", Refuse("Megatron's fault injector is not implemented")),
    ("@autoresume", Refuse("ADLR autoresume is not implemented; SIGTERM saves and exits, launch/ requeues")),
    ("@ft_package", Ignore("no fault-tolerance heartbeats: a hung rank fails the job after the collective timeout")),
    ("@straggler", Ignore("straggler detection is not run")),
    ("@one logger", Ignore("NVIDIA's one-logger telemetry is not sent")),
    ("@opentelemetry", Ignore("OpenTelemetry spans are not emitted")),
    ("@workload inspector", Ignore("the workload inspector server is not run")),
    ("@msc", Ignore("the Multi-Storage Client is not used: paths are local or mounted")),
    ("@moe", Refuse(_MOE)),
)


@lru_cache(maxsize=1)
def megatron_options() -> dict:
    """{"megatron_lm_commit": sha, "options": [...]} (megatron_arguments.json)."""
    with open(OPTIONS) as f:
        return json.load(f)


def rule_for(option: dict):
    """The first rule matching a Megatron option (its first flag, or its group), or None."""
    flag = option["flags"][0]
    for pattern, verdict in RULES:
        if pattern.startswith("@"):
            if option["group"] == pattern[1:]:
                return verdict
        elif flag == pattern or (pattern.endswith("-") and flag.startswith(pattern)):
            return verdict
    return None
