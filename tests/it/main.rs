//! All integration tests, built as one test binary.

/// Shared helpers: running the binary, temporary directories, small models.
mod util;

/// The training step: accumulation, gradients, precisions, loss scaling, learning, resume.
mod training;

/// Data parallelism on CPU ranks: equal to one process, sharding, the launcher, exports.
mod data_parallel;
/// `export`: engine provenance, and documents their tools load, notes apart.
mod exports;

/// Checkpoints: preemption, one run per directory, verification, divergence, retention.
mod checkpoints;

/// Fuzzing the JSON readers and the numeric flags: every input ends in exit 0, 1 or 2.
mod fuzz;

/// The command line: exit codes and messages for bad input.
mod cli;

/// The README against the code: the presets it lists.
mod readme;

/// What `--data` accepts and refuses; model folders; the optimizer's flags.
mod data_formats;

/// The loss over the targets a batch's mask counts, in every engine.
mod loss_mask;

/// A chat fine-tune from a model folder and a JSONL of conversations, then its export.
mod fine_tune;
/// Packed micro-batches: the same loss and gradients as one example a sequence.
mod packing;

/// Plans tuned on the user's own data.
mod data_plans;
/// The longest single sequence a plan or an estimate takes.
mod longest_sequence;

/// A dataset is tokenized once: later runs read it from the token cache.
mod token_cache;

/// Parquet tables and Arrow files (`datasets`' `save_to_disk`) read as records.
mod columnar;

/// The model's tokenizer against `transformers`: ids, offsets, decoding, BOS and EOS, errors.
mod tokenizer;

/// Chat templates against `transformers`' renderings: real models' templates, spans, errors.
mod chat_template;

/// Big numbers in flags and specs: refused naming the field, or answered as not fitting.
mod bounds;

/// Inputs that are no regular file (a FIFO, a device) or larger than any real one: refused.
mod inputs;
/// Configs, checkpoints and flags that would be read as something else: refused in the user's
/// own terms, with nothing written.
mod strict_configs;

/// Tuning on the CPU: exact boundaries, model error, plans that train, bad input.
mod tune;

/// Trials in child processes and in a worker process.
mod isolation;

/// The exec backend through a fake trial runner: failures as outcomes, the boundary, engines.
mod exec;

/// The trial protocol against runners that break it: double and late replies, a runner that
/// never reads, children that escape with `setsid`, NaN.
mod trial_protocol;

/// The PyTorch harness as a trial runner on the CPU (skipped without torch).
mod harness;

/// The GPU bench scripts' Python on the CPU: the kernel-time breakdown and the GEMM shapes.
mod bench_scripts;

/// Compact optimizer state against exact AdamW: loss curves, bytes, resume, refusals.
mod compact_state;

/// `--precision fp8` and `--allow-fp8`: training, refusals and what the search takes.
mod fp8;

/// GPU kernels compiled for the host and run against their definitions (no GPU needed).
mod kernel_host;

/// Fused operations against their composite references.
mod ops;

/// The explicit engine against the composite reference, and its ops against autograd.
mod explicit;

/// Flash attention against an f64 autograd reference.
mod attention;

/// RMS norm, SwiGLU and the rotary embedding against f64 references.
mod decoder_ops;

/// Hugging Face decoders: configs, weights in and out, the engines against `transformers`.
mod decoders;

/// Fused operations on the GPU against their CPU implementations (needs a CUDA device).
#[cfg(feature = "cuda")]
mod cuda_ops;

/// Flash attention on the GPU against the CPU (needs a CUDA device).
#[cfg(feature = "cuda")]
mod cuda_attention;

/// Recorded profiles: check against live re-runs and replays.
mod check;

/// Activation checkpointing and optimizer offload against the plain step.
mod regimes;

/// The committed GPU recordings: replays and re-run checks.
mod recorded;

/// Every committed recording replayed to the exact plan stored beside the tests.
mod replayed_plans;

/// The file tree's layering: no import cycle between top-level modules.
mod layers;

/// The analytic memory estimate against the GPU recordings and CPU probes.
mod estimate;

/// Token files: read a window at a time, so a large corpus costs only the pages batches touch (reads
/// the peak resident memory from /proc).
#[cfg(target_os = "linux")]
mod token_files;

/// `train --metrics` and the learning-rate schedule, across a resume.
mod metrics;

/// The published plan schema against every kind of plan autotune writes.
mod schemas;

/// `report` and `tune --report`: the HTML page, rendered in a headless Chromium.
mod report;
