"""Stage 2, checkpoints as published: ``reader`` (a safetensors file, or shards and their index, read lazily),
``loading`` (each family's tensor names, each rank reading only its experts, every module in its stored
precision), ``formats`` (FP8 blocks, INT4 and MXFP4 as stored, and ``quantization_config``), ``quantized`` (a
rank's quantized experts read as stored) and ``synthetic`` (small checkpoints in the real layouts, for tests and
the demo)."""
