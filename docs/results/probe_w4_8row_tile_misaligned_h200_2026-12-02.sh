export PYTHONPATH=.
for c in "96 96 gated 0 8,32,2,2" "96 96 plain 1 8,32,2,2" "256 96 plain 0 8,32,2,2" "96 96 plain 0 8,64,4,3" "96 96 plain 0 16,32,2,3" "96 64 plain 0 8,32,2,2" "7168 2048 plain 0 8,32,2,2"; do
  timeout 25 python3 docs/results/probe_w4_8row_tile_misaligned_h200_2026-12-02.py $c 2>&1 | grep -v Warn | tail -n 1
done
