"""Training level: the `Trainer` loop (`train`), its jit-compiled step and the step's metrics table
(`step`), the checks a run makes before it starts (`preflight`), the loss and its L1 term
(`loss`), the optimizer and schedule (`optimizer`), dead-neuron tracking and re-initialisation
(`sparsity`), verified checkpoints (`checkpoint`; the run directory around them is
`twell_jax.run_dir`), the metrics sink (`metrics`), stop signals (`signals`), meshes and
multi-host plumbing (`parallel`), the sparse op's "auto" hints of a run (`hints`) and checkpoint
evaluation without a Trainer (`evaluate`). It sits above the op (`twell_jax.ops`), the model, the
data package and the run directory, and below inference and the CLI; import the modules themselves
(`from twell_jax.training import train`)."""
