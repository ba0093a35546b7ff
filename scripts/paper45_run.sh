#!/usr/bin/env bash
# The paper's comparison's runs (docs/paper-comparison.md), one setting and seed at a time,
# exactly the design's commands, in a checkout of the design's commit:
#
#   git worktree add /work/p45/wt <commit> && (cd /work/p45/wt && bash scripts/setup.sh)
#   nohup bash scripts/paper45_run.sh gate /work/p45/wt /work/p45/gate >> gate.log 2>&1 &
#   nohup bash scripts/paper45_run.sh A /work/p45/wt /work/p45/A 0 1 2 >> run.log 2>&1 &
#
# `gate`: the reuse gate's five runs (the stress table's command at seed 0 on reuse8, setting A;
# then `python scripts/paper45.py --gate sqlite:///OUT/mlflow.db`). A or B: the design's runs
# for each seed; `SKIP=grpo,dapo,...` leaves out configurations the gate allowed to be reused
# (their names as the sweeps' `algo` options: grpo dapo bapo clip_higher grpo+recompute; bapo
# leaves out rho0 0.4 only). Each seed gets its own output root and MLflow store (OUT/seedS);
# a finished seed gets a COMPLETE marker and is skipped when the script is run again; a seed cut
# off part-way is deleted and run again whole, so no run appears twice in the read-out. The jobs
# run at nice 10: niceness changes when they run, never what they compute. Export a finished
# seed, unread:
#   python scripts/paper45.py --export sqlite:///OUT/seedS/mlflow.db docs/paper45/setting-A-seedS.csv
set -u
setting=$1 checkout=$2 out=$3
shift 3
case $setting in
  A | gate) kernels=(MKL_CBWR=AVX2 ATEN_CPU_CAPABILITY=avx2) ;;
  B) kernels=(MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default) ;;
  *) echo "error: setting $setting: A, B or gate" >&2; exit 2 ;;
esac
cd "$checkout" || exit 2
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "${kernels[@]}"
arms=experiment=study_v3_reuse8,study_v3_lag8
if [ "$setting" = gate ]; then
  mkdir -p "$out"
  export BAPO_OUTPUT_ROOT=$out
  common=(experiment=study_v3_reuse8 trainer.lr=6e-4 tracking.experiment=algos_stress2 launcher=joblib trainer.seed=0)
  nice -n 10 .venv/bin/bapo train -m algo=grpo,dapo,bapo,clip_higher "${common[@]}" > "$out/log1" 2>&1 &&
    nice -n 10 .venv/bin/bapo train -m algo=grpo trainer.old_logprob=recompute \
      algo.behav_weight_cap=5 "${common[@]}" > "$out/log2" 2>&1 || { echo "gate runs failed ($out)"; exit 1; }
  .venv/bin/python scripts/paper45.py --gate "sqlite:///$out/mlflow.db"
  exit $?
fi
skip=",${SKIP-},"
keep() { [[ $skip != *",$1,"* ]]; }
presets=()
for p in grpo dapo topr dcpo vespo luspo clip_higher; do keep "$p" && presets+=("$p"); done
rhos=0.5
keep bapo && rhos=0.4,0.5
common=("$arms" trainer.lr=6e-4 tracking.experiment=paper45 launcher=joblib)
for s in "$@"; do
  root=$out/seed$s
  [ -e "$root/COMPLETE" ] && continue
  rm -rf "$root"
  mkdir -p "$root"
  export BAPO_OUTPUT_ROOT=$root
  echo "setting $setting seed $s start $(date -u +%T) at $(git rev-parse --short HEAD)"
  run() {  # one of the design's sweeps; its log beside the seed's root
    local log=$root.log$1
    shift
    nice -n 10 .venv/bin/bapo train -m "$@" "${common[@]}" trainer.seed="$s" > "$log" 2>&1 ||
      { echo "seed $s: a sweep failed ($log)"; exit 1; }
  }
  [ ${#presets[@]} -gt 0 ] && run 1 "algo=$(IFS=,; echo "${presets[*]}")"
  run 2 algo=bapo algo.rho0="$rhos"
  run 3 algo=clip_higher algo.eps_high=1.0
  run 4 algo=clip_higher algo.eps_low=0.4 algo.eps_high=0.2
  keep grpo+recompute && run 5 algo=grpo trainer.old_logprob=recompute algo.behav_weight_cap=5
  run 6 algo=grpo trainer.old_logprob=recompute algo.behav_weight_cap=5 rollout.seq_mask=kpop \
    rollout.seq_mask_threshold=2
  touch "$root/COMPLETE"
  echo "setting $setting seed $s done $(date -u +%T)"
done
