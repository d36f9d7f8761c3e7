"""Training level: the `Trainer` loop and its jit-compiled step (`train`), the loss and its L1 term
(`loss`), the optimizer and schedule (`optimizer`), dead-neuron tracking and re-initialisation
(`sparsity`), verified checkpoints and the run directory (`checkpoint`), the metrics sink
(`metrics`), meshes and multi-host plumbing (`parallel`), the sparse op's "auto" hints of a run
(`hints`) and checkpoint evaluation without a Trainer (`evaluate`). It sits above the op
(`twell_jax.ops`), the model and the data package, and below the CLI; import the modules
themselves (`from twell_jax.training import train`)."""
