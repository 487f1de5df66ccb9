#!/usr/bin/env bash
# Issue #63: a CUDA home whose ptxas plants a defect in FA2's modules, for
# `sm121-build aot _vllm_fa2_C.abi3.so --gpu sm_90 --cuda-home HOME` (on the CPU machine, or
# on the GPU's by fa2_prove.sh): the modules that hold HEAD_DIM's kernels
# (`Flash_fwd_kernel_traits<HEAD_DIM, ...>`; `all`: every FA2 module) get every f32 fma
# rounded toward zero (`fma.rn[.ftz].f32` -> `fma.rz[.ftz].f32` in the PTX ptxas is given:
# FA2's are all `.ftz`); every other module is compiled as it is.  The modules it changed
# are listed in HOME/planted.txt.
#
#   bash fa2_plant_ptxas.sh CUDA HOME HEAD_DIM   CUDA: a real toolkit (its bin/ptxas);
#                                                HOME: made here; HEAD_DIM: 32 ... 256 or all
set -eu
CUDA=$1; HOME_DIR=$2; PLANT=$3
case "$PLANT" in all) pattern="" ;; *[!0-9]*|"") echo "HEAD_DIM: a number or all" >&2; exit 2 ;;
                 *) pattern="Li${PLANT}E" ;; esac
bash "$(dirname "$0")/cuda_home_links.sh" "$CUDA" "$HOME_DIR"
cat > "$HOME_DIR/bin/ptxas" <<EOF
#!/usr/bin/env bash
# planted: the modules of head dim $PLANT get every f32 fma rounded toward zero
src="\${@: -1}"
if [[ "\$src" == *.ptx ]] && grep -q "Flash_fwd_kernel_traitsI${pattern}" "\$src"; then
  planted="\${src%.ptx}.planted.ptx"
  sed -E 's/fma\.rn(\.ftz)?\.f32/fma.rz\1.f32/g' "\$src" > "\$planted"
  echo "\$src" >> "$HOME_DIR/planted.txt"
  set -- "\${@:1:\$#-1}" "\$planted"
fi
exec "$CUDA/bin/ptxas" "\$@"
EOF
chmod +x "$HOME_DIR/bin/ptxas"
