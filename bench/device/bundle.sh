#!/usr/bin/env bash
# Everything under $OUT into one $OUT/bundle.tar.gz (and nothing else left there): the device tool brings back at
# most 8 files, 2 folders down, so a call that runs several run_all.sh invocations (one $OUT/<name>/ each) ends with
#   bash bench/device/bundle.sh
# Unpack here with: tar xzf /work/.device/N/bundle.tar.gz -C bench/results/device_<date>/
set -eu
OUT=${OUT:?OUT is not set}
tmp=$(mktemp --suffix=.tar.gz /tmp/bundle.XXXXXX)
tar czf "$tmp" -C "$OUT" .
find "$OUT" -mindepth 1 -delete
mv "$tmp" "$OUT/bundle.tar.gz"
ls -la "$OUT"
