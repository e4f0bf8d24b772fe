"""checkpoints: DeepSeek checkpoints the gate runs on.

The built-in tiny models (tiny); DeepSeek's released config.json files (released) and the tensor
layout a config describes (layout); a checkpoint folder as released, opened from its safetensors
headers and checked against its config (model_dir, safetensors_io); its fingerprint (fingerprint);
released layouts made without a download (fabricate, `model make --like`); the first K layers of a
checkpoint, copied tensor by tensor (slicing, `model slice`); block-FP8 arithmetic (blockfp8,
standalone so that the HF reference runner can load it). Writes model folders, starts no engine.
May import the rules and everything below them.
"""
