"""Models by Hugging Face Hub id: `--model org/name`, `--draft org/name`, `LLM("org/name")` and
`blockspec download`. Resolution (resolve.py) keeps local folders first; fetch.py talks to the
Hub through huggingface_hub; verify.py checks files against the Hub's sizes and hashes."""

from blockspec.hub.resolve import is_hub_id, resolve_model_path, served_name

__all__ = ["is_hub_id", "resolve_model_path", "served_name"]
