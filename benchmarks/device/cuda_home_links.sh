#!/usr/bin/env bash
# A CUDA home made of links to a real toolkit's tools and folders, its ptxas left out for a
# caller to write (c_plant_ptxas.sh, fa2_plant_ptxas.sh: a ptxas that plants a defect).
#
#   bash cuda_home_links.sh CUDA HOME
set -eu
CUDA=$1; HOME_DIR=$2
mkdir -p "$HOME_DIR/bin"
for tool in "$CUDA"/bin/*; do ln -sf "$tool" "$HOME_DIR/bin/"; done
for dir in nvvm include lib64 targets; do
  [ -e "$CUDA/$dir" ] && ln -sfn "$CUDA/$dir" "$HOME_DIR/$dir"
done
rm -f "$HOME_DIR/bin/ptxas"
