"""Inference: load a trained run, generate text with a KV cache, Hugging Face Llama interop.

    from twell_jax.inference import load_run, generate
    loaded = load_run("runs/tiny-20260101-120000")            # params in bf16, config, tokenizer
    print(generate(loaded, ["def main("], max_new_tokens=32).texts[0])
"""
from twell_jax.inference.generate import GenerationResult, Generator, SamplingConfig, generate, sample_tokens
from twell_jax.inference.load import LoadedModel, experiment_config_for, load_run, model_with_params


def lm_eval_harness():
    """`twell_jax.inference.harness` (lm-eval tasks), imported on first use; without lm-eval a
    ValueError of one line naming the extra that installs it (what --tasks reports)."""
    try:
        from twell_jax.inference import harness
    except ImportError as err:
        raise ValueError(f"--tasks: {err}") from None
    return harness


__all__ = ["GenerationResult", "Generator", "LoadedModel", "SamplingConfig", "experiment_config_for", "generate", "load_run",
           "lm_eval_harness", "model_with_params", "sample_tokens"]
