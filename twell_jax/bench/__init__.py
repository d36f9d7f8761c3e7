"""The benchmarks' library: what the scripts in experiments/ share and the tests import.

    ffn          the FFN inputs with a chosen sparsity (`make_inputs`), the timers (`bench`,
                 `bench_interleaved`) and the forward benchmark (`python experiments/bench_ffn.py`)
    ffn_train    the forward + backward benchmark, synthetic or per layer of a trained run
    inference    prefill / decode / energy of a run beside its dense twin and plain JAX
    step         one training step of the model against a plain-JAX Llama (`experiments/bench_step.py`)
    train_to_sparse  train until the FFN layers are sparse: the checkpoint the model-level
                 benchmarks use (`experiments/train_to_sparse.py`)
    plain_llama  a plain-JAX Llama: the baseline rows (nothing of the op in its math)
    kernel_trace per-kernel GPU times of one compiled program from a profiler trace
    report       BENCHMARKS.md, the README's headline table and the plots, from experiments/results/
"""
