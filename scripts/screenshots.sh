#!/bin/sh
# make screenshots: the README's two pictures of the evidence site, taken by headless
# chromium from target/report/ (make report runs first): the index, and the bench page's
# first plots. Writes docs/screenshots/index.png and docs/screenshots/bench.png.
set -eu
TARGET=${TARGET:-target}
browser=""
for b in chromium chromium-browser google-chrome; do
  if command -v "$b" >/dev/null 2>&1; then browser=$b; break; fi
done
if [ -z "$browser" ]; then
  echo "screenshots: no chromium (Debian: apt-get install -y chromium)" >&2
  exit 2
fi
mkdir -p docs/screenshots
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
shot() { # page, png, height
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run \
    --disable-background-networking --user-data-dir="$profile" \
    --window-size=1200,"$3" --screenshot="$2" "file://$(pwd)/$TARGET/report/$1" >/dev/null 2>&1
  [ -s "$2" ] || { echo "screenshots: $2 was not written" >&2; exit 1; }
  echo "screenshots: $2"
}
shot index.html docs/screenshots/index.png 560
shot bench.html docs/screenshots/bench.png 1150
