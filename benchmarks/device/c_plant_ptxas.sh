#!/usr/bin/env bash
# Issue #63: a CUDA home whose ptxas plants a defect confined to one `_C` kernel family, for
# `sm121-build aot _C.abi3.so --gpu sm_90 --cuda-home HOME` (run on the CPU machine):
# the module of Marlin<half, uint4b8, half, half, ...> (GPTQ 4-bit, half activations) gets
# every f32 add rounded toward zero (`add.f32` -> `add.rz.f32` in the PTX ptxas is given);
# every other module is compiled as it is.  The modules it changed are listed in
# HOME/planted.txt.
#
#   bash c_plant_ptxas.sh CUDA HOME    CUDA: a real toolkit (its bin/ptxas); HOME: made here
set -eu
CUDA=$1; HOME_DIR=$2
bash "$(dirname "$0")/cuda_home_links.sh" "$CUDA" "$HOME_DIR"
cat > "$HOME_DIR/bin/ptxas" <<EOF
#!/usr/bin/env bash
src="\${@: -1}"
if [[ "\$src" == *.ptx ]] && grep -q "_ZN6marlin6MarlinILl1125899906910725ELl1125899907892224E" "\$src"; then
  planted="\${src%.ptx}.planted.ptx"
  sed 's/add\.f32/add.rz.f32/g' "\$src" > "\$planted"
  echo "\$src" >> "$HOME_DIR/planted.txt"
  set -- "\${@:1:\$#-1}" "\$planted"
fi
exec "$CUDA/bin/ptxas" "\$@"
EOF
chmod +x "$HOME_DIR/bin/ptxas"
