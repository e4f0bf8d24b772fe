"""checkpoints: DeepSeek checkpoints the gate runs on: the built-in tiny models (tiny).

Writes model folders (config.json, safetensors, tokenizer) but starts no engine. May import the
rules and everything below them.
"""
