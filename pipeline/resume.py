"""Resuming a source from its records: where a moved source starts again.

A source's JSON Lines file holds one record per frame, in frame order, written under
``NAME.partial.jsonl`` until its source ends (``stages.sinks.JsonlWriter``); each batch part
goes out in one write, so a pipeline killed mid-run leaves complete lines and at most one
torn last line. Resuming keeps the complete lines, drops the torn one and starts the source
at the frame after the last record (``SourceConfig.start_frame``); the new sink appends to
the same file (``SinkStage(resume_from=...)``), so the file ends up holding every frame once,
in order.

A file source's partial records carry where they came from: the file's path, size and
modification time, stamped on the ``.partial`` JSONL file as an extended attribute
(``ORIGIN_ATTRIBUTE``; no file is added, and a rename keeps it). Resuming checks it
(``check_origin``): records of another file are not continued (a new user's resume with
another ``uri`` put two clips' frames in one file). Where the file system keeps no extended
attributes, nothing is stamped and nothing is checked.

A tracked source resumed starts with fresh tracks, numbered on from its records: its first id
is one past the largest ``tracker_id`` of its kept records (``next_tracker_id``), so an id
names one object in the whole file, as it does in a run that was never cut.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

from pipeline.config import PipelineConfig, SourceConfig, partial_path

TAIL_CHUNK = 64 * 1024  # bytes read at a time from the end of a file
SCAN_CHUNK = 4 * 1024 * 1024  # bytes read at a time scanning a whole file
# a detection's track id in a record (``stages.sinks.detection_records``); -1 (no track)
# does not match. A quote inside a JSON string is escaped: only a key matches.
_TRACKER_ID = re.compile(rb'"tracker_id"\s*:\s*(\d+)')
ORIGIN_ATTRIBUTE = "user.streamdet.origin"


def file_origin(uri: str) -> dict[str, object] | None:
    """A file source's identity: {"path": its absolute path with symlinks resolved, "size":
    bytes, "mtime_ns": its modification time}, or None when it cannot be read (a stream URL:
    not a file)."""
    try:
        stat = os.stat(uri)
    except (OSError, ValueError):
        return None
    return {"path": os.path.realpath(uri), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def stamp_origin(path: Path, origin: dict[str, object]) -> bool:
    """Stamp ``origin`` (``file_origin``) on the records file ``path``; False where its file
    system keeps no extended attributes (nothing is then checked when it resumes)."""
    try:
        os.setxattr(path, ORIGIN_ATTRIBUTE, json.dumps(origin, sort_keys=True).encode())
    except (OSError, AttributeError):  # not supported here (AttributeError: not Linux)
        return False
    return True


def read_origin(path: Path) -> dict[str, object] | None:
    """The origin stamped on ``path``, or None (none stamped, or not readable here)."""
    try:
        return json.loads(os.getxattr(path, ORIGIN_ATTRIBUTE))
    except (OSError, AttributeError, ValueError):
        return None


def check_origin(source: SourceConfig, jsonl_path: Path, resume_at: int) -> None:
    """Refuse to resume ``source`` from records of another file.

    Args:
        jsonl_path: its records' final path (the ``.partial`` twin is read).
        resume_at: the frame it would resume at (one past its last record).

    Raises:
        ValueError: the partial records carry an origin that is not ``source``'s file now
            (another path, size or modification time).
    """
    partial = partial_path(jsonl_path)
    stamped, now = read_origin(partial), file_origin(source.uri)
    if stamped is None or now is None or stamped == now:
        return
    held = f"{str(partial)!r} holds records up to frame {resume_at - 1} of"
    if stamped.get("path") == now["path"]:
        raise ValueError(f"{held} {str(now['path'])!r} as it was then ({_describe(stamped)}), "
                         f"and it has changed since ({_describe(now)})")
    raise ValueError(f"{held} {str(stamped.get('path'))!r} ({_describe(stamped)}), not of "
                     f"{source.name}'s uri now, {str(now['path'])!r} ({_describe(now)}): "
                     "give that file again")


def _describe(origin: dict[str, object]) -> str:
    import datetime

    when = datetime.datetime.fromtimestamp(int(origin.get("mtime_ns", 0)) / 1e9)
    return f"{int(origin.get('size', 0)):,} bytes, modified {when:%Y-%m-%d %H:%M:%S}"


def cut_torn_line(path: Path) -> bytes | None:
    """Truncate ``path`` after its last newline (a line written halfway by a killed process
    goes) and return its last complete line (without the newline), or None when it holds
    none. Reads only the file's tail."""
    with open(path, "r+b") as file:
        size = file.seek(0, os.SEEK_END)
        end = _last_newline(file, size)
        if end is None:
            file.truncate(0)
            return None
        if end + 1 != size:
            file.truncate(end + 1)
        start = _last_newline(file, end)
        file.seek(0 if start is None else start + 1)
        return file.read(end - (0 if start is None else start + 1))


def _last_newline(file, before: int) -> int | None:  # noqa: ANN001 - a binary file
    """Offset of the last ``\\n`` strictly before ``before``, or None."""
    position = before
    while position > 0:
        start = max(0, position - TAIL_CHUNK)
        file.seek(start)
        found = file.read(position - start).rfind(b"\n")
        if found >= 0:
            return start + found
        position = start
    return None


def resume_point(jsonl_path: Path) -> int:
    """The frame a source resumes at: one past the ``"frame"`` of the last complete record of
    its partial JSONL file (``jsonl_path`` is the final path; its ``.partial`` twin is read and
    its torn last line cut), or 0 when there is none.

    Raises:
        ValueError: the last complete line is not a record (the file is not ours).
    """
    partial = partial_path(jsonl_path)
    if not partial.exists():
        return 0
    line = cut_torn_line(partial)
    if line is None:
        return 0
    try:
        return int(json.loads(line)["frame"]) + 1
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{str(partial)!r}: its last line is not a frame record: "
                         f"{line[:80]!r}") from None


def next_tracker_id(jsonl_path: Path) -> int:
    """The first tracker id of a tracked source resuming after its records: one past the
    largest ``"tracker_id"`` of the complete lines of its partial JSONL file (``jsonl_path``
    is the final path; its ``.partial`` twin is read, and a torn last line is not counted),
    or 0 when there is none. Reads the whole file (once, in chunks, without parsing it).
    """
    partial = partial_path(jsonl_path)
    if not partial.exists():
        return 0
    largest = -1
    rest = b""  # a line begun in the chunk before
    with open(partial, "rb") as file:
        while chunk := file.read(SCAN_CHUNK):
            chunk = rest + chunk
            end = chunk.rfind(b"\n") + 1
            ids = _TRACKER_ID.findall(chunk, 0, end)
            if ids:
                largest = max(largest, max(map(int, ids)))
            rest = chunk[end:]
    return largest + 1


def resumed_sources(config: PipelineConfig, names: list[str]) -> list[SourceConfig]:
    """Copies of the sources ``names`` (in that order) of ``config``, each with its
    ``start_frame`` set to its resume point: where its records stop. A source whose records
    are not written (``output.jsonl: null``) starts at its configured ``start_frame`` again."""
    by_name = {source.name: source for source in config.sources}
    resumed = []
    for name in names:
        source = copy.deepcopy(by_name[name])
        if config.output.jsonl:
            point = resume_point(config.output_path(config.output.jsonl, name))
            source.start_frame = max(source.start_frame, point)
        resumed.append(source)
    return resumed


def cut_files(config: PipelineConfig) -> dict[str, int]:
    """{name: resume frame} of every file source whose records an earlier run left cut short
    (a ``.partial`` JSONL file with records): the frame after its last record. Logs each.

    Raises:
        ValueError: a ``.partial`` JSONL file whose last line is not a record (not ours), or
            whose records came from another file (``check_origin``).
    """
    import structlog

    from pipeline.config import is_stream_url

    files = [s for s in config.sources if not s.is_live and not is_stream_url(s.uri)]
    cut = {}
    for old, moved in zip(files, resumed_sources(config, [s.name for s in files])):
        if moved.start_frame > old.start_frame:
            check_origin(old, config.output_path(config.output.jsonl, old.name),
                         moved.start_frame)
            cut[old.name] = moved.start_frame
            structlog.get_logger("resume").info(
                "resuming a file cut short after its last record", source=old.name,
                from_frame=moved.start_frame)
    return cut
