#!/usr/bin/env bash
# make test's stages, one after another: `scripts/run_stages.sh test-cpp test-python ...`.
# Each runs as `make <stage>`; the first that fails stops the run. At the end (or at that failure)
# a table says which stages passed, which failed, which were not run, and how long each took.
set -uo pipefail
MAKE=${MAKE:-make}
declare -a names results times
failed=0
for stage in "$@"; do
  names+=("$stage")
  if [ "$failed" -ne 0 ]; then results+=("not run"); times+=("-"); continue; fi
  echo "==== make $stage"
  start=$SECONDS
  if $MAKE --no-print-directory "$stage"; then results+=("passed"); else results+=("FAILED"); failed=1; fi
  times+=("$(( (SECONDS - start) / 60 ))m$(( (SECONDS - start) % 60 ))s")
done
echo
echo "==== make test: the stages"
for i in "${!names[@]}"; do printf '  %-18s %-8s %s\n' "${names[$i]}" "${results[$i]}" "${times[$i]}"; done
printf '  %-18s %s\n' "in all" "$(( SECONDS / 60 ))m$(( SECONDS % 60 ))s"
exit "$failed"
