#!/bin/sh
# The learner image's entrypoint (after tini), as any uid, before the server or command it
# is given: the learner's folder and model cache, as the hubs make them. Never fails the
# start: where nothing is writable (grade_sandbox.py's read-only sandboxes) it changes
# nothing it cannot.
#
# - /home/jovyan/work/minivllm-course: a link to the course in the image (chapters, released
#   labs). Not `minivllm`: in that folder a link of that name shadows the package, and
#   `from minivllm import LLM` fails for a notebook saved there (an older image's link of
#   that name, in a kept volume, is removed).
# - MINIVLLM_CACHE: the image's converted model is in /opt/minivllm-cache, read-only for
#   learners; the quantized checkpoints chapters 15-17, 28 and 30 and labs 17 and 28 build on
#   first use need a cache the learner may write. Where MINIVLLM_CACHE is that read-only
#   folder, it becomes .cache/minivllm in the first writable of /home/jovyan/work, $HOME,
#   /tmp; a cache elsewhere (the hubs set one in the learner's home) is kept. Its `models`
#   is a link to the image's converted model, unless it has its own.
shared=/opt/minivllm-cache
work=/home/jovyan/work
if [ -d "$work" ] && [ -w "$work" ]; then
    [ "$(readlink "$work/minivllm")" = /opt/minivllm ] && rm -f "$work/minivllm"
    ln -sfn /opt/minivllm "$work/minivllm-course" 2>/dev/null
fi
cache=${MINIVLLM_CACHE:-$shared}
if [ "$cache" = "$shared" ] && [ ! -w "$shared" ]; then
    for dir in "$work" "$HOME" /tmp; do
        if [ -n "$dir" ] && [ -d "$dir" ] && [ -w "$dir" ]; then
            cache=$dir/.cache/minivllm
            break
        fi
    done
fi
if [ "$cache" != "$shared" ] && mkdir -p "$cache" 2>/dev/null; then
    [ -e "$cache/models" ] || ln -sfn "$shared/models" "$cache/models" 2>/dev/null
    export MINIVLLM_CACHE="$cache"
fi
exec "$@"
