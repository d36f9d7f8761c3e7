"""The benchmarks' library: each benchmark's code (its command is `experiments/<command>.py`, a shim
over the module's `main`, or `python -m twell_jax.bench.<module>`; experiments/README.md), and what
they share. The tests import these modules, never a script.

Shared pieces:
    ffn          the FFN inputs with a chosen sparsity (`make_inputs`), the timers (`bench`,
                 `bench_interleaved`) and the forward benchmark (`python experiments/bench_ffn.py`)
    patterns     synthetic gate sparsity with the shape of a trained layer
    bounds       what each Pallas piece moves against what the GPU allows
    plain_llama  a plain-JAX Llama: the baseline rows (nothing of the op in its math)
    kernel_trace per-kernel GPU times of one compiled program from a profiler trace
    report       BENCHMARKS.md, the README's headline table and the plots, from experiments/results/

Benchmarks and experiments (one command each, experiments/README.md has the table):
    ffn_train    the forward + backward benchmark, synthetic or per layer of a trained run
    step         one training step of the model against a plain-JAX Llama (`experiments/bench_step.py`)
    inference    prefill / decode / energy of a run beside its dense twin and plain JAX
    train_to_sparse  train until the FFN layers are sparse: the checkpoint the model-level
                 benchmarks use (`experiments/train_to_sparse.py`)
    transpose, compile_time, data_parallel, metrics_fetch, eval_speed, backend_equivalence,
    compare_profiles, measure_corpus, explore_token_kernel, explore_slice_kernel
"""
