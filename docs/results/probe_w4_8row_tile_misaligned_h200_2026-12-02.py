import sys, torch
sys.path.insert(0, "tests/interpreter"); sys.path.insert(0, "tests")  # the W4 test file's helpers
import test_grouped_mlp_w4 as t
from moe_ref.experts import ExpertLayout
w4 = t.w4
hidden, inter, step, fmt_i, tile = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), tuple(map(int, sys.argv[5].split(",")))
fmt = t.W4[fmt_i]
q = t._qweights(fmt, 3, hidden, inter, "cuda", seed=3)
gu = t._planes(q)[0]
layout = ExpertLayout.from_counts(torch.tensor(t.COUNTS, device="cuda"), alignment=16, num_pool_rows=64)
x, valid = t._pool(layout, hidden, torch.bfloat16, "cuda", seed=4)
seg = (layout.row_start_e, layout.num_rows_e)
try:
    if step == "plain":
        P = torch.zeros(64, 2 * inter, device="cuda"); w4.launch_w4_gemm(x, gu, P, *seg, rows_hint=24, tile=tile)
    else:
        h = torch.zeros(64, inter, dtype=torch.bfloat16, device="cuda"); w4.launch_w4_gemm(x, gu, h, *seg, rows_hint=24, tile=tile, activation="silu")
    torch.cuda.synchronize(); r = "ok"
except Exception as e:
    r = "FAIL " + str(e)[:60]
print(sys.argv[1:], r, flush=True)
