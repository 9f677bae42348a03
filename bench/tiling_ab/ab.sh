# A/B of tilings.py tables in true on-policy mode at 1.7B, one GPU call (~6 min): the current table, the
# table before the TMA wiring (95d2f68^), and the current one with TMA rows run as matmul.py tiles (made here from it); then
# kernels_bench at 1.7B. Run from the repository root on the GPU: OUT=dir bash bench/tiling_ab/ab.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T=lockstep_kernels/gpu/tilings.py; cp $T bench/tiling_ab/tilings_new.py
sed 's/, "tma")/)/g' $T > bench/tiling_ab/tilings_notma.py  # the TMA rows as matmul.py tiles
S="--sizes 1.7b --steps 5 --set train.recompute_activations=true"
run() { # variant mode
  mkdir -p /tmp/ab_$1/ckpt; [ -e /tmp/ab_$1/ckpt/1.7b ] || [ ! -e /tmp/ab_base/ckpt/1.7b ] || ln -s /tmp/ab_base/ckpt/1.7b /tmp/ab_$1/ckpt/1.7b
  cp bench/tiling_ab/tilings_$1.py $T
  timeout 150 python3 bench/gpu_matrix.py $S --modes $2 --work /tmp/ab_$1 --out $OUT/ab_$1_$2.json > $OUT/ab_$1_$2.log 2>&1
  echo "$1 $2 rc=$?"; grep "^| 1.7b" $OUT/ab_$1_$2.log
}
mkdir -p /tmp/ab_base; timeout 150 python3 bench/gpu_matrix.py $S --modes default --work /tmp/ab_base --out $OUT/ab_new_default.json > $OUT/ab_new_default.log 2>&1; echo "default rc=$?"; grep "^| 1.7b" $OUT/ab_new_default.log
run new true_on_policy
run old true_on_policy
run notma true_on_policy
cp bench/tiling_ab/tilings_new.py $T
timeout 120 python3 bench/kernels_bench.py --presets 1.7b --m 1,16,128,256,2048,16384 > $OUT/kernels_1.7b.log 2>&1; echo "kernels rc=$?"; tail -40 $OUT/kernels_1.7b.log
