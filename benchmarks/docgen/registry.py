"""The results BENCHMARKS.md expects: the commands that write them (:data:`PENDING`), and the scheme lists those
commands use."""

from __future__ import annotations

RECORD = "python benchmarks/record.py"
NETBENCH = "python -m gradcompress netbench"
LM_DEMO = "gradcompress demo --task lm"
ALL_SCHEMES = ("ddp;torch-fp16;torch-powersgd;none;fp16;int8;int4;sign;topk:ratio=0.01;powersgd:rank=1;"
               "powersgd:rank=4;auto;auto:budget=any")
GROWTH_SCHEMES = "ddp;fp16;int8;sign;topk:ratio=0.01;powersgd:rank=1"
#: the configurations tried for a recipe below 1/1000 of DDP's bytes (issue 40)
RECIPE_SCHEMES = ("int2:diloco=100,inner=muon;int2:diloco=100;int2:diloco=100,fragments=4,delay=5,inner=muon;"
                  "int2:diloco=100,fragments=4,delay=5;int4:diloco=200;int4:diloco=200,inner=muon;"
                  "none:diloco=100,outer=sparseloco,inner=muon;int2:diloco=200,inner=muon;int2:diloco=50,inner=muon")
RECIPE = "int2:diloco=100,fragments=4,delay=5,inner=muon"
#: the second model size (issue 40): DDP's lr sweep, the recipe and blocking DiLoCo with AdamW inside
LARGE_LRS = ("0.001", "0.003", "0.01")
SIZE_SCHEMES = f"{RECIPE};int2:diloco=100"
DILOCO_LM = "ddp;int8;int4;int4:diloco=50;int4:diloco=50,fragments=4,delay=5"
DILOCO_MLP = "int4:diloco=50;int4:diloco=50,fragments=4,delay=10"


#: the selection's stability check: the five fixed schemes once, auto ten times, in one run
SELECTION = ";".join(["ddp", "torch-fp16", "fp16", "int8", "int4"] + ["auto"] * 10)


def _netbench(name: str, args: str, minutes: int) -> tuple[str, int, str | None]:
    return f"{RECORD} {name} -- {NETBENCH} {args} --json", minutes, None


# name -> (command that writes benchmarks/results/NAME.json, minutes it should take on the 2-core machine (estimated
# from the measurement log's runs), what must change first or None). netbench needs root (network namespaces).
PENDING: dict[str, tuple[str, int, str | None]] = {
    "netbench_mlp_10gbit": _netbench("netbench_mlp_10gbit", "--workers 4 --bandwidth 10gbit --model mlp --steps 10 "
                                     f"--warmup 10 --timeout 1800 --schemes '{ALL_SCHEMES}'", 3),
    "netbench_mlp_1gbit": _netbench("netbench_mlp_1gbit", "--workers 4 --bandwidth 1gbit --model mlp --steps 10 "
                                    f"--warmup 10 --timeout 1800 --schemes '{ALL_SCHEMES}'", 4),
    "netbench_mlp_100mbit": _netbench("netbench_mlp_100mbit", "--workers 4 --bandwidth 100mbit --model mlp --steps 5 "
                                      f"--warmup 10 --timeout 1800 --schemes '{ALL_SCHEMES}'", 15),
    "auto_selection_mlp_10gbit": _netbench("auto_selection_mlp_10gbit", "--workers 4 --bandwidth 10gbit --model mlp "
                                           f"--steps 5 --warmup 20 --timeout 1800 --schemes '{SELECTION}'", 5),
    "auto_selection_mlp_1gbit": _netbench("auto_selection_mlp_1gbit", "--workers 4 --bandwidth 1gbit --model mlp "
                                          f"--steps 5 --warmup 20 --timeout 1800 --schemes '{SELECTION}'", 5),
    "auto_selection_mlp_100mbit": _netbench("auto_selection_mlp_100mbit", "--workers 4 --bandwidth 100mbit --model "
                                            f"mlp --steps 5 --warmup 20 --timeout 1800 --schemes '{SELECTION}'", 8),
    "auto_matrix_fitted": (f"{RECORD} auto_matrix_fitted --from /tmp/matrix_fitted.json -- python "
                           "benchmarks/auto_matrix.py --half fitted --out /tmp/matrix_fitted.json", 25,
                           "needs root: network namespaces"),
    "auto_matrix_heldout": (f"{RECORD} auto_matrix_heldout --from /tmp/matrix_heldout.json -- python "
                            "benchmarks/auto_matrix.py --half heldout --out /tmp/matrix_heldout.json", 25,
                            "needs root: network namespaces; run after the fitted half, the constants unchanged"),
    "auto_matrix_recheck": (f"{RECORD} auto_matrix_recheck --from /tmp/matrix_recheck.json -- python "
                            "benchmarks/auto_matrix.py --recheck benchmarks/results/auto_matrix_fitted.json "
                            "benchmarks/results/auto_matrix_heldout.json --out /tmp/matrix_recheck.json", 20,
                            "needs root: network namespaces; after both halves"),
    "lm_auto_seed1_lr1e-2_300": (f"{RECORD} lm_auto_seed1_lr1e-2_300 --from /tmp/lm_seed1/results.json -- {LM_DEMO} "
                                 "--steps 300 --lr 1e-2 --seed 1 --schemes 'none;auto:bandwidth=100mbit' "
                                 "--no-progress --out /tmp/lm_seed1", 6, None),
    "auto_heldout": (f"{RECORD} auto_heldout -- python benchmarks/auto_heldout.py --seed $(git rev-parse HEAD) --n 6 "
                     "--json", 60, "the shared tools next to the checkout (../shared/tools/heldout.py)"),
    "netbench_mlp_1gbit_w2": _netbench("netbench_mlp_1gbit_w2", "--workers 2 --bandwidth 1gbit --model mlp --steps 5 "
                                       f"--schemes '{GROWTH_SCHEMES}'", 2),
    "netbench_mlp_1gbit_w8": _netbench("netbench_mlp_1gbit_w8", "--workers 8 --bandwidth 1gbit --model mlp --steps 5 "
                                       f"--schemes '{GROWTH_SCHEMES}'", 5),
    "codec_speed": (f"{RECORD} codec_speed -- python -m gradcompress bench --numel 25000000 --repeats 5 --json", 2,
                    None),
    "instep": (f"{RECORD} instep -- python -m gradcompress bench --in-step --codecs "
               "'none;fp16;int8;sign;topk:ratio=0.01;powersgd:rank=4' --json", 1, None),
    "instep_versus_torch": (f"{RECORD} instep_versus_torch -- python -m gradcompress bench --in-step --versus-torch "
                            "--json", 1, None),
    "dense_hook_overhead": (f"{RECORD} dense_hook_overhead -- python benchmarks/dense_hook_overhead.py "
                            "--modes ddp,none,auto --rounds 3 --json", 3, None),
    "randomk_seeds_200": (f"{RECORD} randomk_seeds_200 -- python benchmarks/convergence_seeds.py --seeds 5 --steps 200 "
                          "--schemes 'none;randomk:ratio=0.25,scale=false;randomk:ratio=0.25,scale=false,momentum=0.9'"
                          " --json", 2, None),
    "lm_auto_any_lr3e-3_300": (f"{RECORD} lm_auto_any_lr3e-3_300 --from /tmp/lm_auto/results.json -- {LM_DEMO} "
                               "--steps 300 --schemes 'none;int4;auto:bandwidth=100mbit;auto:bandwidth=100mbit,"
                               "budget=any' --out /tmp/lm_auto", 6, None),
    "digits_auto_any": (f"{RECORD} digits_auto_any --from /tmp/digits_auto/results.json -- gradcompress demo "
                        "--schemes 'none;auto:bandwidth=100mbit;auto:bandwidth=100mbit,budget=any' "
                        "--out /tmp/digits_auto", 1, None),
    "fsdp_mlp_1gbit": _netbench("fsdp_mlp_1gbit", "--fsdp --workers 4 --bandwidth 1gbit --model mlp --steps 6", 3),
    "fsdp_mlp_100mbit": _netbench("fsdp_mlp_100mbit", "--fsdp --workers 4 --bandwidth 100mbit --model mlp --steps 3 "
                                  "--timeout 1800", 8),
    "hsdp_lm_300": (f"{RECORD} hsdp_lm_300 " + " ".join(f"--from /tmp/hsdp/{n}/results.json" for n in
                                                        ("none", "int8", "int4", "int8p")) +
                    " -- bash -c 'T=\"python -m gradcompress train --task lm --workers 4 --steps 300 --fsdp --hsdp\";"
                    " $T --codec none --out /tmp/hsdp/none && $T --codec int8 --out /tmp/hsdp/int8 &&"
                    " $T --codec int4 --out /tmp/hsdp/int4 && $T --codec int8 --params int8 --out /tmp/hsdp/int8p'",
                    12, None),
    "ftbench_1gbit": (f"{RECORD} ftbench_1gbit -- python -m gradcompress.testbed.ftbench --hosts 4 --rate 1gbit "
                      "--steps 20 --warmup 5 --model mlp --json", 4, None),
    "ftbench_loopback": (f"{RECORD} ftbench_loopback -- python -m gradcompress.testbed.ftbench --hosts 4 --steps 20 "
                         "--warmup 5 --model mlp --json", 3, None),
    "torchft_stall": (f"{RECORD} torchft_stall -- python benchmarks/torchft_stall.py --repeats 3 --json", 3, None),
    "torchft_faults": (f"{RECORD} torchft_faults -- python benchmarks/torchft_faults.py --repeats 3 --json", 10,
                       "needs root for the cut link: network namespaces"),
    "demo_faults": (f"{RECORD} demo_faults --from /tmp/ft/faults.json -- gradcompress demo --faults --out /tmp/ft", 3,
                    None),
    "diloco_lm_10mbit": _netbench("diloco_lm_10mbit", "--workers 4 --bandwidth 10mbit --model lm --steps 100 "
                                  f"--timeout 1800 --schemes '{DILOCO_LM}'", 9),
    "diloco_lm_100mbit": _netbench("diloco_lm_100mbit", "--workers 4 --bandwidth 100mbit --model lm --steps 100 "
                                   f"--schemes '{DILOCO_LM}'", 3),
    "diloco_lm_1gbit": _netbench("diloco_lm_1gbit", "--workers 4 --bandwidth 1gbit --model lm --steps 100 "
                                 f"--schemes '{DILOCO_LM}'", 2),
    "lm_recipe_900": (f"{RECORD} lm_recipe_900 --from /tmp/lm_recipe/results.json -- {LM_DEMO} --steps 900 "
                      f"--eval-every 50 --no-progress --schemes '{RECIPE_SCHEMES}' --out /tmp/lm_recipe", 15, None),
    "lm_recipe_seed1_900": (f"{RECORD} lm_recipe_seed1_900 --from /tmp/lm_recipe1/results.json -- {LM_DEMO} --steps "
                            f"900 --eval-every 50 --no-progress --seed 1 --schemes '{RECIPE}' --out /tmp/lm_recipe1",
                            3, None),
    "time_to_loss": (f"{RECORD} time_to_loss -- python benchmarks/time_to_loss.py --recipe 'recipe={RECIPE}' "
                     "--plot docs/time-to-loss.png --json", 30, "needs root: network namespaces"),
    "lm_large_ddp_lr_sweep_300": (f"{RECORD} lm_large_ddp_lr_sweep_300 " + " ".join(
        f"--from /tmp/lml_{lr}/results.json" for lr in LARGE_LRS) + f" -- bash -c 'for LR in {' '.join(LARGE_LRS)}; "
        f"do {LM_DEMO} --lm-size large --steps 300 --schemes none --lr $LR --no-progress --out /tmp/lml_$LR; done'",
        11, None),
    "lm_large_recipe_900": (f"{RECORD} lm_large_recipe_900 --from /tmp/lml_recipe/results.json -- {LM_DEMO} "
                            f"--lm-size large --steps 900 --eval-every 50 --no-progress --schemes '{SIZE_SCHEMES}' "
                            "--out /tmp/lml_recipe", 30, None),
    "lm_diloco_900": (f"{RECORD} lm_diloco_900 --from /tmp/lm_diloco/results.json -- {LM_DEMO} --steps 900 --schemes "
                      "'none:diloco=25;int4:diloco=25;int4:diloco=50;topk:ratio=0.03,values=int8,diloco=25' "
                      "--out /tmp/lm_diloco", 7, None),
    "diloco_mlp_10mbit": _netbench("diloco_mlp_10mbit", "--workers 4 --bandwidth 10mbit --model mlp --steps 100 "
                                   f"--timeout 1800 --schemes '{DILOCO_MLP}'", 4),
    "diloco_mlp_100mbit": _netbench("diloco_mlp_100mbit", "--workers 4 --bandwidth 100mbit --model mlp --steps 100 "
                                    f"--schemes '{DILOCO_MLP}'", 3),
}


# Pending results whose format no section renders yet: once recorded, their section says so until one does.
UNRENDERED: set[str] = set()
