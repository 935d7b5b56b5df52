# source bench/device/setup_osmesa.sh  (from bench/device/run_all.sh gl=osmesa; GL=auto: only make OSMesa loadable)
# It installs neither MuJoCo's wheels nor the GLVND debs of .gl (without them EGL cannot load and auto falls back to
# OSMesa): run_all.sh does both first (`bash bench/device/run_all.sh parts=none gl=auto` sets up and runs gl_check).
#
# GL=auto (run_all.sh gl=auto, or `GL=auto . bench/device/setup_osmesa.sh`): libOSMesa goes on the library path and
# MUJOCO_GL is unset, so the env configs' render_backend=auto measures EGL (on the GPU) against OSMesa and chooses
# (bench/device/gl_check.py prints the figures and the choice).
# MuJoCo renders on the CPU (Mesa's llvmpipe through OSMesa) instead of the GPU through EGL, so that env workers do
# not time-slice the GPU with the action server (bench/device/bench_contention.py measured why). The machine has no
# Mesa: a carried .mesa/osmesa.tar.xz (Debian bookworm-backports libosmesa6 25.0.7 + bookworm libllvm15, libdrm2 and
# libz3-4 as fallbacks) is unpacked into .mesa-root/ (ignored by git, so it stays there for the next call on a warm
# machine, and into /opt/wamkit-mesa). Support libraries the machine already has are used from the machine. On success: MUJOCO_GL=osmesa.
# Carry .mesa with .whl-lite (fetch_osmesa.sh: the wheels with MetaWorld slimmed to the assets its tasks open), not
# .whl: ~52 MiB in all, one call (.mesa 32.5 MB + the full .whl 46 MB did not fit 64 MiB).
# Session 3 saw .mesa-root/ gone at the next call on the same warm machine (it was ignored only in .git/info/exclude,
# which does not travel; .gitignore now names it); /opt/wamkit-mesa, outside the synced tree, is the second place.
M=""
for d in "$PWD/.mesa-root" /opt/wamkit-mesa; do
  if [ -e "$d/lib/libOSMesa.so" ]; then M=$d; break; fi
done
if [ -z "$M" ] && [ -f .mesa/osmesa.tar.xz ]; then
  M=$PWD/.mesa-root
  mkdir -p "$M" /opt/wamkit-mesa && tar xJf .mesa/osmesa.tar.xz -C "$M" && cp -a "$M/lib" /opt/wamkit-mesa/
fi
if [ -n "$M" ] && [ -e "$M/lib/libOSMesa.so" ]; then
  for so in libdrm.so.2 libz3.so.4; do
    if ldconfig -p | grep -q "/$so\$"; then rm -f "$M/lib/$so"; fi
  done
  export LD_LIBRARY_PATH=$M/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export LP_NUM_THREADS=${LP_NUM_THREADS:-1}
  if [ "${GL:-osmesa}" = auto ]; then
    unset MUJOCO_GL PYOPENGL_PLATFORM   # render_backend=auto (the env configs' default) measures egl vs osmesa
    echo "gl: osmesa available from $M/lib ($(ls "$M/lib" | tr '\n' ' ')); MUJOCO_GL unset: render_backend=auto chooses"
  else
    export MUJOCO_GL=osmesa PYOPENGL_PLATFORM=osmesa
    echo "gl: osmesa from $M/lib ($(ls "$M/lib" | tr '\n' ' '))"
  fi
else
  [ "${GL:-osmesa}" = auto ] && unset MUJOCO_GL PYOPENGL_PLATFORM
  echo "gl: no OSMesa here (.mesa/osmesa.tar.xz not carried, .mesa-root/ not left by an earlier call): EGL on the GPU"
fi
