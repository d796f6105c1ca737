#!/usr/bin/env bash
# Every row of the whole-run memory table (BENCHMARKS.md) from one build, spread over the
# GPUs of the machine: each row is `scripts/budget_rows.sh` on a GPU of its own (its own
# holder keeps all but the row's budget of that card), the rows of a GPU one after another.
# Build here (FLAME_CUDA_SASS=90: the kernels' H100/H200 machine code embedded, no compile of
# their PTX on the GPU machine's first run):
#   FLAME_CUDA_SASS=90 ../shared/gpu/bundle --bin train --bin sample --bench train_step --features cuda
#   cd .gpu && tar cf - train sample bench-train_step | xz -T1 --lzma2=preset=6,dict=400MiB > bins.tar.xz \
#     && rm -f train sample bench-*
# (one dictionary over the binaries, which embed the same kernels: about 2 MB a binary more
# than the first)
# then, there, with carry [".gpu", ".whl"] (diffusers for the pipelines):
#   [FAMILIES="sd3 ..."] bash scripts/budget_table.sh make PIPES   random full-size Flux-dev, SD3.5-large and
#                                                     SDXL pipelines in PIPES/{flux,sd3,sdxl}
#     (FAMILIES=flux-gguf: PIPES/flux-q8 and PIPES/flux-q4k, ComfyUI models/ folders with a
#     random full-size FLUX.1-dev GGUF in Q8_0 (12.7 GB) / Q4_K (6.8 GB) in city96's layout,
#     scripts/random_flux_gguf.py, beside CLIP-L, T5-XXL and the autoencoder as single files;
#     it needs gguf-py: `python3 scripts/random_flux_gguf.py --wheel .whl` here puts it in
#     .whl/, installed there with the other wheels or imported from .whl/ as it is)
#   [SAMPLE_STEPS=N] bash scripts/budget_table.sh rows PIPES WORK ROW...   the rows named (or "all"), ROW k on
#                                                     GPU k mod the GPU count (SAMPLE_STEPS:
#                                                     the samples' denoising steps, 20 unless
#                                                     given: scripts/budget_rows.sh)
#   bash scripts/budget_table.sh steps [MODEL...]    the step of each row's plan against the
#                                                     resident step (benches/train_step.rs): one
#                                                     process a model alternating them (Flux-dev,
#                                                     SD3.5-large), a process a plan alternating
#                                                     SDXL_ROUNDS times, 4 unless given (SDXL:
#                                                     each budget's pick and its rivals, and the
#                                                     fastest of them each round, the step
#                                                     `train` keeps after timing them), the
#                                                     budget split as the train binary splits it
#                                                     (what the process holds outside its
#                                                     allocator, measured, and LATE_HEADROOM);
#                                                     `steps flux sd35` and `steps sdxl` fit a
#                                                     call each
#   bash scripts/budget_table.sh fresh MODEL REPS "" "--budget 8" ...   a process a plan, in turn,
#                                                     REPS times: each plan's steps over the
#                                                     first's (a round's, the means', the medians')
# Device time on one H200 (build 36876ef, SAMPLE_STEPS=4): `make` 103 s for sd3 and sdxl, about
# 90 s for flux (its 64 GiB disk holds flux or sd3, not both: remove one's folder first); the
# rows 80-250 s each with their `sample` runs (sdxl8 the least, flux8 the most); `steps`
# about 420-520 s. A fresh machine adds about 275 s to its first call.
#   SAMPLE_STEPS=4 bash scripts/budget_table.sh part N PIPES WORK   the eight rows and their steps in four
#                                                     calls of the device (N = 1..4, in turn,
#                                                     on one warm machine: see `part` below),
#                                                     the two default-budget rows in 1 and 5
#   bash scripts/budget_table.sh gpus PIPES WORK N   the Flux-dev 12 GiB row on N GPUs at once
#   bash scripts/budget_table.sh summary WORK        a table line a row run under WORK
#   [BUDGET=12] bash scripts/budget_table.sh products PIPES   `sample --budget` on the Flux-dev pipeline
#                                                     (1024², 4 steps) with the streamed blocks'
#                                                     conditioning products on the device, then on
#                                                     the host (FLAME_PLANNER=host_products=off/on):
#                                                     each run's plan, time lines and exit
# Rows: flux24 flux12 flux8 flux6 (FP8, AdamW8bit) sd3-16 sd3-8 sdxl8 sdxl4; sdxl4-default and
# flux12-default give the run no budget on a card held to 4 / 12 GiB free (the default
# budget: the memory free at start; `sample` without --budget too; not in "all"); and the newer
# families at their smallest bf16 budgets: klein4b-6 klein9b-8 zimage-6, and in FP8:
# klein4b-4fp8 zimage-4fp8 klein9b-6fp8, and an edit dataset (reference images,
# instructions) on Klein 4B within 6 GiB: klein4b-edit-6 (FAMILIES="klein4b klein9b zimage"
# for `make`; they are not in "all"); the GGUF Flux-dev models, their packed Linears decoded
# per matmul, the rest in bf16: flux-q4k-6 (Q4_K within 6 GiB) and flux-q8-8 (Q8_0 within
# 8 GiB) (FAMILIES=flux-gguf for `make`; not in "all").
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
cd "$root"
[ -x .gpu/train ] || { (cd .gpu && xz -dc bins.tar.xz | tar xf -); }
# Wheels carried in .whl/ (diffusers for `make`) import as they are, without installing.
for w in "$root"/.whl/*.whl; do [ -f "$w" ] && export PYTHONPATH="$w${PYTHONPATH:+:$PYTHONPATH}"; done
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
if ! ls /usr/lib/x86_64-linux-gnu/libnccl.so >/dev/null 2>&1; then
  mkdir -p /tmp/nccl && ln -sf /usr/lib/x86_64-linux-gnu/libnccl.so.2 /tmp/nccl/libnccl.so
  export LD_LIBRARY_PATH=/tmp/nccl:$LD_LIBRARY_PATH
fi
ngpu=$(nvidia-smi -L | wc -l)
ALL="flux24 flux12 flux8 flux6 sd3-16 sd3-8 sdxl8 sdxl4"

# fresh MODEL REPS ARGS...: each ARGS (a string: "" is the resident step) in a process of its
# own, in turn, REPS times, each process 8 timed steps and `--phases`; prints every
# process's step (ms, the median of its steps), then each plan's steps over the first's:
# a round's ratios, the ratio of the means and of the medians; with KEPT="I J ...[, K L ...]"
# (groups of plan indices: say a budget's pick and its rivals, "--budget 4" and "--budget 4
# --rival K"), also the fastest of each group each round, over the first plan: the step
# `train` runs after timing the pick and its rivals (`memory.trial_steps`). A process a
# plan leaves no
# plan's state to the next (its pinned memory, its threads, the allocator's arena) and
# spreads each plan over the same minutes of the host's pace.
fresh() {
  local model=$1 reps=$2; shift 2
  local -a plans=("$@")
  local log=/tmp/fresh-$model; mkdir -p "$log"; : > "$log/steps"
  local r i ms
  # The driver compiles the kernels' PTX at a machine's first use of each module (tens of
  # seconds), then reads its disk cache: one untimed step of the first plan and of the last
  # first (the resident step's modules and a streaming plan's), so no timed process pays it
  # (nor runs into its time limit).
  for i in $(printf "%s\n" 0 $((${#plans[@]} - 1)) | sort -u); do
    # shellcheck disable=SC2086
    timeout 300 .gpu/bench-train_step --model "$model" --steps 1 ${plans[$i]} > "$log/warm-$i.log" 2>&1
    grep -h "^kernel modules" "$log/warm-$i.log" | sed "s/^/== warm-up, plan $i: /"
  done
  for ((r = 0; r < reps; r++)); do
    for i in "${!plans[@]}"; do
      # shellcheck disable=SC2086
      timeout 90 .gpu/bench-train_step --model "$model" --steps 8 --phases ${plans[$i]} \
        > "$log/$r-$i.log" 2>&1
      ms=$(grep -o 'samples/s): [0-9.]* ms' "$log/$r-$i.log" | grep -o '[0-9.]* ms' | head -n 1)
      echo "== $model round $r, plan $i (${plans[$i]:-resident}): ${ms:-failed}"
      grep -E "^phases|plan:|predicted step" "$log/$r-$i.log" | cut -c1-300
      # The host's costs this process timed, which its planner played.
      grep -o "[0-9.]*/[0-9.]* µs an op and its backward on the host and [^,]*" "$log/$r-$i.log" \
        | head -n 1 | sed 's/^/host: /'
      echo "$r $i ${ms% ms}" >> "$log/steps"
    done
  done
  awk -v n="${#plans[@]}" -v kept="${KEPT:-}" '
    $3 != "" { t[$2, $1] = $3; rounds = ($1 + 1 > rounds) ? $1 + 1 : rounds }
    function median(a, k,   i, j, x) {
      for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (a[j] < a[i]) { x = a[i]; a[i] = a[j]; a[j] = x }
      return (k % 2) ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2
    }
    END {
      for (i = 0; i < n; i++) {
        k = 0; sum = 0; line = ""; ratios = ""
        delete v
        for (r = 0; r < rounds; r++) if ((i, r) in t) {
          v[++k] = t[i, r]; sum += t[i, r]; line = line sprintf("%s%.1f", k > 1 ? ", " : "", t[i, r])
          if ((0, r) in t) ratios = ratios sprintf("%s%.2fx", ratios == "" ? "" : ", ", t[i, r] / t[0, r])
        }
        if (k == 0) { printf "== plan %d: no step timed\n", i; continue }
        mean[i] = sum / k; med[i] = median(v, k)
        if (i == 0) printf "== plan 0: %s ms; mean %.1f, median %.1f\n", line, mean[0], med[0]
        else printf "== plan %d: %s ms; over plan 0 %s a round, %.2fx of the means, %.2fx of the medians\n", i, line, ratios, mean[i] / mean[0], med[i] / med[0]
      }
      # Each group of KEPT (groups split by commas): the fastest of its plans each round
      # that timed plan 0 and at least one of them (a rival the planner did not work out in
      # that process has no step, as `train` times none).
      groups = split(kept, gs, ",")
      for (gi = 1; gi <= groups; gi++) {
        gsub(/^ +| +$/, "", gs[gi])
        m = split(gs[gi], ks, " ")
        if (m == 0) continue
        k = 0; sum = 0; base = 0; line = ""; ratios = ""
        delete v; delete bv
        for (r = 0; r < rounds; r++) {
          if (!((0, r) in t)) continue
          best = ""
          for (j = 1; j <= m; j++)
            if (((ks[j], r) in t) && (best == "" || t[ks[j], r] < best)) best = t[ks[j], r]
          if (best == "") continue
          v[++k] = best; sum += best; base += t[0, r]; bv[k] = t[0, r]
          line = line sprintf("%s%.1f", k > 1 ? ", " : "", best)
          ratios = ratios sprintf("%s%.2fx", ratios == "" ? "" : ", ", best / t[0, r])
        }
        if (k == 0) { printf "== kept (plans %s): no round timed one of them\n", gs[gi]; continue }
        printf "== kept (the fastest of plans %s): %s ms; over plan 0 %s a round, %.2fx of the means, %.2fx of the medians\n", gs[gi], line, ratios, (sum / k) / (base / k), median(v, k) / median(bv, k)
      }
    }' "$log/steps"
}

# One row on GPU $1: ROW PIPES WORK.
row() {
  local g=$1 name=$2 pipes=$3 work=$4
  local arch budget dtype=bf16 opt=adamw pipe= edit=0 default=0
  case $name in
    flux24) arch=flux budget=24 ;;
    flux12) arch=flux budget=12 ;;
    flux8) arch=flux budget=8 ;;
    flux6) arch=flux budget=6 dtype=fp8 opt=adamw8bit ;;
    sd3-16) arch=sd3 budget=16 ;;
    sd3-8) arch=sd3 budget=8 ;;
    sdxl8) arch=sdxl budget=8 ;;
    sdxl4) arch=sdxl budget=4 ;;
    # No budget given, the card holding only that much free: the default budget.
    sdxl4-default) arch=sdxl budget=4 default=1 ;;
    flux12-default) arch=flux budget=12 default=1 ;;
    klein4b-6) arch=flux2 pipe=klein4b budget=6 ;;
    klein9b-8) arch=flux2 pipe=klein9b budget=8 ;;
    zimage-6) arch=zimage budget=6 ;;
    klein4b-edit-6) arch=flux2 pipe=klein4b budget=6 edit=1 ;;
    klein4b-4fp8) arch=flux2 pipe=klein4b budget=4 dtype=fp8 ;;
    klein9b-6fp8) arch=flux2 pipe=klein9b budget=6 dtype=fp8 ;;
    zimage-4fp8) arch=zimage budget=4 dtype=fp8 ;;
    flux-q4k-6) arch=flux pipe=flux-q4k budget=6 ;;
    flux-q8-8) arch=flux pipe=flux-q8 budget=8 ;;
    *) echo "row $name: one of $ALL sdxl4-default flux12-default klein4b-6 klein9b-8 zimage-6 klein4b-edit-6 klein4b-4fp8 klein9b-6fp8 zimage-4fp8 flux-q4k-6 flux-q8-8" >&2; return 2 ;;
  esac
  DEFAULT_BUDGET=$default EDIT=$edit GPUS=$g ARCH=$arch MODEL_DTYPE=$dtype OPTIMIZER=$opt SAMPLE_EXE=$root/.gpu/sample \
    bash "$here/budget_rows.sh" "$pipes/${pipe:-$arch}" "$work/$name" "$root/.gpu/train" "$budget" \
    > "$work/$name.log" 2>&1
  echo "== row $name on GPU $g: exit $?"
  grep -E "^== |memory:|timing plans|peaks|^time:|^kernels:|^done:" "$work/$name.log" | head -n 24
}

case ${1:-} in
  make)
    pipes=$2
    mkdir -p "$pipes"
    pids=()
    for f in ${FAMILIES:-flux sd3 sdxl}; do
      [ -d "$pipes/$f/vae" ] && { echo "$pipes/$f: there"; continue; }
      # A pipeline's size on disk (GB, as made; the makes run at once, so each takes its
      # share of what is free): a disk too small fails the make halfway and leaves a
      # folder the train binary refuses, so say so before starting.
      case $f in flux) need=34 ;; sd3) need=27 ;; sdxl) need=7 ;; *) need=0 ;; esac
      [ -n "${free:-}" ] || free=$(df --output=avail -B1G "$pipes" | tail -n 1 | tr -d ' ')
      if [ "$need" -gt "$free" ]; then
        echo "== make $f: needs about $need GB, $free GB left under $pipes; remove another family's folder first" >&2
        continue
      fi
      free=$((free - need))
      args=(--make "$pipes/$f" --family "$f")
      [ $f = flux ] && args=(--make "$pipes/$f" --transformer)
      if [ $f = flux-gguf ]; then
        [ -f "$pipes/flux-q4k/unet/flux1-dev-Q4_K_S.gguf" ] && { echo "$pipes/flux-q4k: there"; continue; }
        args=(--make "$pipes" --family flux-gguf)
      fi
      g=$(( ${#pids[@]} % ngpu ))
      (CUDA_VISIBLE_DEVICES=$g python3 benches/torch_encoders.py "${args[@]}" \
        > "$pipes/make-$f.log" 2>&1; echo "== made $f: exit $?"; tail -n 3 "$pipes/make-$f.log") &
      pids+=($!)
    done
    wait "${pids[@]}"
    du -sh "$pipes"/* ;;
  rows)
    pipes=$2 work=$3
    shift 3
    rows=("$@")
    [ "${rows[*]}" = all ] && read -r -a rows <<< "$ALL"
    mkdir -p "$work"
    pids=()
    for g in $(seq 0 $((ngpu - 1))); do
      (k=0
       for r in "${rows[@]}"; do
         [ $((k % ngpu)) = "$g" ] && row "$g" "$r" "$pipes" "$work"
         k=$((k + 1))
       done) &
      pids+=($!)
    done
    wait "${pids[@]}" ;;
  steps)
    # steps [MODEL...]: flux, sd35, sdxl (all three unless named).
    # Flux-dev and SD3.5-large: one process a model, the resident step and each budget's
    # plan alternating round by round (`--alternate`): the ratios of one process, whose host
    # keeps one pace.
    # Each run prints the machine its planner played (`machine:`, the host's costs timed in
    # that process): with it the CPU's time model replays these plans.
    # b SECONDS ARGS...: one bench process, cut after SECONDS (Flux-dev's five plans took
    # more than 200 s on build 2a68aa0: its sixth run, FP8 within 6 GiB, was cut).
    b() { local t=$1; shift; echo "== $*"; timeout "$t" .gpu/bench-train_step "$@" 2>&1 \
      | grep -E "^== |^machine:|LoRA step|rror" | cut -c1-700; }
    shift
    for m in ${@:-flux sd35 sdxl}; do
      case $m in
        flux) b 320 --model flux --steps 5 --rounds 1 --alternate "--budget 24" --alternate "--budget 12" \
                --alternate "--budget 8" --alternate "--budget 6 --fp8 --adam8bit" ;;
        sd35) b 200 --model sd35 --steps 5 --rounds 1 --alternate "--budget 16" --alternate "--budget 8" ;;
        # SDXL's steps follow the host's pace of the moment: the resident step ran 101-175
        # ms from process to process on two H200 machines within minutes (2026-12-04), a
        # round's ratio 0.74-1.39x within 8 GiB. A process a plan, alternating, SDXL_ROUNDS
        # times (4 unless given: nine plans, 36 processes, about 200 s), so each plan's mean
        # and median span the same minutes and the rounds outnumber the spread.
        # Each budget's pick and its rivals (`--rival K`), the fastest of them each round
        # the step `train` keeps after timing them (`memory.trial_steps`; KEPT in fresh).
        sdxl) KEPT="1 2 3 4, 5 6 7 8" fresh sdxl "${SDXL_ROUNDS:-4}" "" \
                "--budget 8" "--budget 8 --rival 1" "--budget 8 --rival 2" "--budget 8 --rival 3" \
                "--budget 4" "--budget 4 --rival 1" "--budget 4 --rival 2" "--budget 4 --rival 3" ;;
        *) echo "steps: flux, sd35 or sdxl, not $m" >&2; exit 2 ;;
      esac
    done ;;
  fresh)
    # fresh MODEL REPS "ARGS" "ARGS"...: a process a plan (the first ARGS the reference,
    # "" for the resident step), the plans in turn, REPS times.
    shift; fresh "$@" ;;
  part)
    # part N PIPES WORK: the eight rows and their steps in four calls of at most 600 s each,
    # and a fifth for the Flux-dev default-budget row
    # on one H200 (SAMPLE_STEPS=4; the machine kept warm between the calls, so PIPES stays
    # there; .gpu holds train, sample and bench-train_step of one build). Each call's time
    # from build d9ced4a's rows (train run + `sample` run, s), `make` and `steps`:
    #   1: make sd3 + sdxl (103), sdxl8 (50), sdxl4 (49), steps sdxl (about 200)
    #                                                                          about 400 s
    #   2: sd3-16 (99), sd3-8 (136), steps sd35 (200 at most), sd3's folder removed,
    #      make flux (90)                                                      about 530 s
    #   3: flux24 (101), flux12 (163), flux8 (161)                             about 430 s
    #   4: flux6 (FP8, AdamW8bit; 199), steps flux (320 at most)               about 520 s
    #   5: flux12-default (no budget given, 12 GiB of the card free)          about 170 s
    # (part 1 also runs sdxl4-default, about 35 s more: SDXL with no budget given on a
    # card with 4 GiB free)
    # A fresh machine's first process also waits for the driver's compile of the kernels
    # (tens of seconds to two minutes) unless the build embeds their machine code
    # (FLAME_CUDA_SASS=90 for H100 and H200).
    t=$here/budget_table.sh
    n=$2 pipes=$3 work=$4
    case $n in
      1) FAMILIES="sd3 sdxl" bash "$t" make "$pipes" && bash "$t" rows "$pipes" "$work" sdxl8 sdxl4 \
           sdxl4-default && bash "$t" steps sdxl ;;
      2) bash "$t" rows "$pipes" "$work" sd3-16 sd3-8 && bash "$t" steps sd35 \
           && rm -rf "$pipes/sd3" && FAMILIES=flux bash "$t" make "$pipes" ;;
      3) bash "$t" rows "$pipes" "$work" flux24 flux12 flux8 ;;
      4) bash "$t" rows "$pipes" "$work" flux6 && bash "$t" steps flux ;;
      5) bash "$t" rows "$pipes" "$work" flux12-default ;;
      *) echo "part 1, 2, 3, 4 or 5" >&2; exit 2 ;;
    esac ;;
  summary)
    # summary WORK: a line a row run under WORK (its log WORK/ROW.log): the train run's exit,
    # driver-side peak (the holder's way) and time, its memory plan, and the `sample` run's
    # exit, driver-side peak and time and its plan; for the benchmark's table.
    work=$2
    for log in "$work"/*.log; do
      name=$(basename "$log" .log)
      grep -q "^== budget" "$log" 2>/dev/null || continue
      awk -v row="$name" '
        /^== budget/ { match($0, /exit [0-9]+ in [0-9.]+ s/); run = substr($0, RSTART, RLENGTH)
                       match($0, /driver-side peak [0-9.]+ GiB/); peak = substr($0, RSTART + 17, RLENGTH - 17) }
        /^memory:/ && plan == "" { plan = substr($0, 9, 220) }
        /^driver-side peaks/ && phases == "" { sub(/^[^:]*: /, ""); phases = $0 }
        /^== sample/ { match($0, /exit [0-9]+ in [0-9]+ s/); srun = substr($0, RSTART, RLENGTH)
                       match($0, /peak -?[0-9]+ MiB/); speak = substr($0, RSTART + 5, RLENGTH - 5) }
        /^sample memory:/ && splan == "" { splan = substr($0, 16, 200) }
        END { printf "| %s | %s, peak %s | %s | phases: %s | sample: %s, peak %s | %s |\n", row, run, peak, plan, phases, srun, speak, splan }
      ' "$log"
    done ;;
  products)
    pipes=$2
    for hp in off on; do
      out=$(mktemp -d)
      start=$(date +%s)
      FLAME_PLANNER=host_products=$hp timeout 300 .gpu/sample --arch flux --model "$pipes/flux" \
        --prompt "a red circle on a white background" --steps 4 --guidance 3.5 --width 1024 \
        --height 1024 --budget "${BUDGET:-12}" --out "$out/images" > "$out/sample.log" 2>&1
      echo "== sample --budget ${BUDGET:-12}, host_products=$hp: exit $? in $(( $(date +%s) - start )) s"
      grep -E "^memory:|^time:|driver-side peaks|rror" "$out/sample.log" | cut -c1-600
      rm -rf "$out"
    done ;;
  gpus)
    pipes=$2 work=$3 n=$4
    list=$(seq -s, 0 $((n - 1)))
    mkdir -p "$work"
    GPUS=$list ARCH=flux SAMPLE_EXE=$root/.gpu/sample \
      bash "$here/budget_rows.sh" "$pipes/flux" "$work/flux12-x$n" "$root/.gpu/train" 12 \
      > "$work/flux12-x$n.log" 2>&1
    echo "== Flux-dev 12 GiB on $n GPUs: exit $?"
    grep -E "^== |memory:|peaks|data-parallel" "$work/flux12-x$n.log" | head -n 16 ;;
  *)
    sed -n 2,30p "$0"; exit 2 ;;
esac
