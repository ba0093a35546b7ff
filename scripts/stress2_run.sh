#!/usr/bin/env bash
# The stress design's runs (docs/algorithms.md, "The stress table again"), one seed at a time,
# exactly the design's two commands per seed, in a checkout of the commit that runs them:
#
#   git worktree add /work/stress2/wt 657327d && (cd /work/stress2/wt && bash scripts/setup.sh)
#   nohup bash scripts/stress2_run.sh B /work/stress2/wt /work/stress2/B 3 4 5 6 7 >> run.log 2>&1 &
#
# Each seed gets its own output root and MLflow store (OUT/seedS); a finished seed gets a
# COMPLETE marker and is skipped when the script is run again; a seed cut off part-way is
# deleted and run again whole, so no run appears twice in the read-out. The jobs run at nice 10:
# niceness changes when they run, never what they compute. Export a finished seed, unread:
#   python scripts/stress2.py --export sqlite:///OUT/seedS/mlflow.db docs/algos-pairs/stress2/setting-B-seedS.csv
set -u
setting=$1 checkout=$2 out=$3
shift 3
case $setting in
  A) kernels=(MKL_CBWR=AVX2 ATEN_CPU_CAPABILITY=avx2) ;;
  B) kernels=(MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default) ;;
  *) echo "error: setting $setting: A or B" >&2; exit 2 ;;
esac
cd "$checkout" || exit 2
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "${kernels[@]}"
common=(experiment=study_v3_reuse8,study_v3_lag8 trainer.lr=6e-4 tracking.experiment=algos_stress2 launcher=joblib)
for s in "$@"; do
  root=$out/seed$s
  [ -e "$root/COMPLETE" ] && continue
  rm -rf "$root"
  mkdir -p "$root"
  export BAPO_OUTPUT_ROOT=$root
  echo "setting $setting seed $s start $(date -u +%T) at $(git rev-parse --short HEAD)"
  nice -n 10 .venv/bin/bapo train -m 'algo=glob(*)' "${common[@]}" trainer.seed="$s" \
    > "$root.log1" 2>&1 || { echo "seed $s: the presets' sweep failed ($root.log1)"; exit 1; }
  nice -n 10 .venv/bin/bapo train -m algo=grpo trainer.old_logprob=loglinear,recompute \
    algo.behav_weight_cap=5 "${common[@]}" trainer.seed="$s" \
    > "$root.log2" 2>&1 || { echo "seed $s: the decoupled sweep failed ($root.log2)"; exit 1; }
  touch "$root/COMPLETE"
  echo "setting $setting seed $s done $(date -u +%T)"
done
