# The workspace's packages, for scripts that build and install them (sourced, not run).
# shellcheck shell=bash
packages=(moestack-devices moestack-kernels moestack-checkpoint moestack-dispatch
  moestack-parallel moestack-data moestack-plan moestack-train)
declare -A module_of=(
  [moestack-devices]=moe_devices
  [moestack-kernels]=moe_kernels
  [moestack-checkpoint]=moe_checkpoint
  [moestack-dispatch]=moe_dispatch
  [moestack-parallel]=moe_parallel
  [moestack-data]=moe_data
  [moestack-plan]=moe_plan
  [moestack-train]=moe_train
)
# The sibling wheels each package needs (its moestack-* dependencies, transitively).
declare -A wheel_deps=(
  [moestack-devices]=""
  [moestack-kernels]="moestack-devices"
  [moestack-checkpoint]=""
  [moestack-dispatch]="moestack-devices moestack-kernels"
  [moestack-parallel]=""
  [moestack-data]=""
  [moestack-plan]="moestack-devices moestack-data"
  [moestack-train]="moestack-devices moestack-kernels moestack-dispatch moestack-parallel
    moestack-checkpoint moestack-data moestack-plan"
)
