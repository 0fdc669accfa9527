#!/bin/bash
# A second tree for a same-run A/B on the GPU machine (whose copy of the repository may have
# no git history): the library (dosa_jax, pallas_kernels) at COMMIT, without its data
# (gpu.sh links the working tree's), and the working tree's benchmarks, in DIR.
#
#   bash benchmarks/ab_tree.sh COMMIT [DIR]        (DIR default: abtree)
#
# DIR is an untracked folder of the working tree, so a remote run carries it; then
#   AB_TREE=DIR bash benchmarks/gpu.sh decode_loop_ab
# times the loop study in both trees, alternating. Delete DIR afterwards.
set -euo pipefail
commit=${1:?usage: bash benchmarks/ab_tree.sh COMMIT [DIR]}
dir=${2:-abtree}
rm -rf "$dir"
mkdir -p "$dir/benchmarks"
git archive "$commit" dosa_jax pallas_kernels | tar -x -C "$dir"
rm -rf "$dir/dosa_jax/data"
cp benchmarks/*.py "$dir/benchmarks/"
echo "$(git rev-parse --short "$commit")" > "$dir/COMMIT"
echo "$dir: the library at $(cat "$dir/COMMIT"), this tree's benchmarks"
