"""Stage 2, checkpoints as published: ``loading`` (each family's tensor names, sharded safetensors, each rank
reading only its experts), ``formats`` (FP8 blocks, INT4 and MXFP4 as stored, and ``quantization_config``),
``quantized`` (a rank's quantized experts read as stored) and ``synthetic`` (small checkpoints in the real
layouts, for tests and the demo)."""
