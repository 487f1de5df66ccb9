#!/usr/bin/env bash
# Device: bash .devbuild/eqc/eqc.sh   (repo root; carry .devbuild)
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH=$CUDA_HOME/bin:$PATH EQC=/tmp/eqcrun
echo "image TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-unset}"; export EQC_IMAGE_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-unset} TORCH_CUDA_ARCH_LIST=12.1 EQC_REPS=${EQC_REPS:-0}
T=$SECONDS
date; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvcc --version | tail -1
which cuobjdump nvdisasm python3
mkdir -p /tmp/site $EQC
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  $(ls .devbuild/whl/*.whl | grep -v -e typing_extensions -e packaging) 2>&1 | tail -2
tar -xJf .devbuild/cutlass-v4.7.0.tar.xz -C /tmp
echo "setup $((SECONDS-T)) s"
python3 .devbuild/eqc/eqc_build.py 2>&1 | tee $EQC/build-driver.log
echo "build step done at $((SECONDS-T)) s"
python3 .devbuild/eqc/eqc_compare.py 2>&1 | tee $EQC/compare.log
echo "compare rc=${PIPESTATUS[0]} at $((SECONDS-T)) s"
for f in gptq awq; do
  [ -f $EQC/runs/$f-link.cubin ] && command -v nvdisasm >/dev/null && {
    nvdisasm $EQC/runs/$f-aot-sm90.cubin > $EQC/runs/$f-aot.sass 2>&1
    nvdisasm $EQC/runs/$f-link.cubin > $EQC/runs/$f-jit.sass 2>&1
    diff $EQC/runs/$f-aot.sass $EQC/runs/$f-jit.sass > $EQC/runs/$f-sass.diff; echo "$f sass diff lines: $(wc -l < $EQC/runs/$f-sass.diff)"; }
done
cd /tmp && tar -cJf $OUT/eqcrun.tar.xz --exclude='*.pt' eqcrun
cp $EQC/equivalence-full.json $EQC/build.json $OUT/ 2>/dev/null
ls -la $OUT; echo "total $((SECONDS-T)) s"
