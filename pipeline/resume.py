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

They also carry what made them (``RecordsSettings``, a second attribute,
``SETTINGS_ATTRIBUTE``): the model's files (path, size, modification time) and the settings
that decide which detections are recorded (thresholds, classes, region of interest, ...).
Resuming compares them with the run's (``check_settings``): records of another model, or of
other thresholds, are not continued (the file would hold two kinds of records). Records
stamped without them (an earlier version), or where the file system keeps no extended
attributes, resume unchecked, with one warning (``cut_files``).

A run that writes no video (``output.video: null``) does not continue the video an earlier run
of the file left cut short: ``cut_files`` warns, naming it, and it is kept as it was.

A tracked source resumed starts with fresh tracks, numbered on from its records: its first id
is one past the largest ``tracker_id`` of its kept records (``next_tracker_id``), so an id
names one object in the whole file, as it does in a run that was never cut.
"""

from __future__ import annotations

import copy
import datetime
import errno
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import structlog

from pipeline.config import (
    OutputConfig,
    PipelineConfig,
    SourceConfig,
    is_stream_url,
    partial_path,
)

TAIL_CHUNK = 64 * 1024  # bytes read at a time from the end of a file
SCAN_CHUNK = 4 * 1024 * 1024  # bytes read at a time scanning a whole file
# a detection's track id in a record (``stages.sinks.detection_records``); -1 (no track)
# does not match. A quote inside a JSON string is escaped: only a key matches.
_TRACKER_ID = re.compile(rb'"tracker_id"\s*:\s*(\d+)')
ORIGIN_ATTRIBUTE = "user.streamdet.origin"
SETTINGS_ATTRIBUTE = "user.streamdet.settings"
# The format of ``SETTINGS_ATTRIBUTE``'s value. A setting added later is a new key (a stamp
# without it is not checked for it); a key whose meaning changes needs a new version (a stamp
# of another version is not checked).
SETTINGS_VERSION = 1
# What decides which detections a file source's records hold, by configuration key as the
# messages name it: the model's files (their ``file_origin``), the run's settings and the
# source's own (``sources[]``: its entry; the tracker's only with a tracker). The model's input
# size is the model file's.
FILE_SETTINGS = ("model.path", "model.class_names")
RUN_SETTINGS = ("model.layout", "nms.conf_threshold", "nms.iou_threshold", "nms.class_agnostic",
                "nms.max_detections")
SOURCE_SETTINGS = ("classes", "roi", "detect_every", "detect_fps", "tracker")
TRACKER_SETTINGS = ("tracker_new_confidence", "tracker_lost_s", "tracker_class_aware")
LONG_SETTING = 80  # characters of JSON: a longer value (a large roi) is stamped as a digest
# where an earlier run's video is looked for when this run writes none (its name then is not
# known): the default name
EARLIER_VIDEO = OutputConfig().video or "{source}.mp4"

log = structlog.get_logger("resume")


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
    when = datetime.datetime.fromtimestamp(int(origin.get("mtime_ns", 0)) / 1e9)
    return f"{int(origin.get('size', 0)):,} bytes, modified {when:%Y-%m-%d %H:%M:%S}"


@dataclass(frozen=True)
class RecordsSettings:
    """What made a file source's records, besides its frames: each setting of
    ``FILE_SETTINGS`` (a file's ``file_origin``, or None), ``RUN_SETTINGS`` and
    ``SOURCE_SETTINGS`` by its key (``nms.conf_threshold``, ``sources[].classes``), as a JSON
    value (one longer than ``LONG_SETTING`` characters as ``{"sha256": ...}``).

    Stamped on a new records file (``stamp_settings``) as
    ``{"version": SETTINGS_VERSION, "settings": {...}}`` and compared on resume
    (``check_settings``).
    """

    values: dict[str, object]

    @classmethod
    def of(cls, config: PipelineConfig, source: SourceConfig) -> RecordsSettings:
        """The settings ``source``'s records are made with in a run of ``config``."""
        values: dict[str, object] = {}
        for key in FILE_SETTINGS:
            path = getattr(config.model, key.split(".")[1])
            values[key] = None if path is None else file_origin(path)
        for key in RUN_SETTINGS:
            section, name = key.split(".")
            values[key] = _stamp_value(getattr(getattr(config, section), name))
        tracked = source.tracker != "none"
        for name in SOURCE_SETTINGS + (TRACKER_SETTINGS if tracked else ()):
            values[f"sources[].{name}"] = _stamp_value(getattr(source, name))
        return cls(values)

    def to_bytes(self) -> bytes:
        """The attribute's value."""
        return json.dumps({"version": SETTINGS_VERSION, "settings": self.values},
                          sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RecordsSettings | None:
        """The settings an attribute's value holds; None when it is of another version (or
        not ours)."""
        try:
            stamp = json.loads(data)
            values = stamp["settings"]
        except (ValueError, TypeError, KeyError):
            return None
        if stamp.get("version") != SETTINGS_VERSION or not isinstance(values, dict):
            return None
        return cls(values)

    def changes(self, now: RecordsSettings, index: int) -> list[str]:
        """What differs in ``now``, one text per setting (``nms.conf_threshold was 0.25, now
        0.4``; ``index``: the source's place in ``sources``); a key one of them lacks (a
        setting added since) is not compared."""
        found = []
        for key, was in self.values.items():
            if key not in now.values or now.values[key] == was:
                continue
            shown = key.replace("sources[]", f"sources[{index}]")
            if key in FILE_SETTINGS:
                found.append(_file_change(shown, was, now.values[key]))
            elif isinstance(was, dict) or isinstance(now.values[key], dict):
                found.append(f"{shown} has changed")  # a digest: the value is long
            else:
                found.append(f"{shown} was {json.dumps(was)}, now {json.dumps(now.values[key])}")
        return found


def _stamp_value(value: object) -> object:
    """``value`` as stamped: as JSON reads it back, or its digest when it is long."""
    text = json.dumps(value, sort_keys=True)
    if len(text) > LONG_SETTING:
        return {"sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}
    return json.loads(text)


def _file_change(key: str, was: object, now: object) -> str:
    """A model file's change: another file, or the same one changed since."""
    if isinstance(was, dict) and isinstance(now, dict) and was.get("path") == now.get("path"):
        return (f"{key} {str(now['path'])!r} has changed since ({_describe(was)} then, "
                f"{_describe(now)} now)")
    return f"{key} was {_file_text(was)}, now {_file_text(now)}"


def _file_text(origin: object) -> str:
    if not isinstance(origin, dict):
        return "null"
    return f"{str(origin.get('path'))!r} ({_describe(origin)})"


def stamp_settings(path: Path, settings: RecordsSettings) -> bool:
    """Stamp ``settings`` on the records file ``path``; False where its file system keeps no
    extended attributes (it then resumes unchecked, with a warning)."""
    try:
        os.setxattr(path, SETTINGS_ATTRIBUTE, settings.to_bytes())
    except (OSError, AttributeError):  # not supported here (AttributeError: not Linux)
        return False
    return True


def check_settings(config: PipelineConfig, source: SourceConfig, jsonl_path: Path,
                   resume_at: int) -> str | None:
    """Refuse to resume ``source`` from records made with another model or other settings
    than ``config``'s (``RecordsSettings``).

    Args:
        jsonl_path: its records' final path (the ``.partial`` twin is read).
        resume_at: the frame it would resume at (one past its last record).

    Returns:
        None when they were checked; else why they could not be (no stamp: an earlier
        version wrote them; a file system without extended attributes; another version's).

    Raises:
        ValueError: the stamped settings differ from the run's (the message says which).
    """
    partial = partial_path(jsonl_path)
    try:
        data = os.getxattr(partial, SETTINGS_ATTRIBUTE)
    except AttributeError:  # not Linux
        return "this system keeps no extended attributes"
    except OSError as error:
        if error.errno == errno.ENODATA:
            return "they were not stamped on the records (an earlier version wrote them)"
        if error.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return "their file system keeps no extended attributes"
        return f"their stamp could not be read ({error.strerror})"
    stamped = RecordsSettings.from_bytes(data)
    if stamped is None:
        return "their stamp is of another version"
    index = next(i for i, s in enumerate(config.sources) if s.name == source.name)
    changes = stamped.changes(RecordsSettings.of(config, source), index)
    if changes:
        raise ValueError(f"{str(partial)!r} holds records up to frame {resume_at - 1} made "
                         f"with other settings ({'; '.join(changes)}): set them back to "
                         "continue it")
    return None


def video_parts(path: Path) -> dict[Path, int]:
    """{file: its first frame} of the parts of output ``path``'s video in its folder, final
    (``cam.from-1200.mp4``) or cut short (``cam.from-1200.partial.mp4``): only names
    ``stages.sinks.resumed_video_path`` (and ``partial_path`` of one) makes."""
    pattern = re.compile(rf"{re.escape(path.stem)}\.from-(\d+)(\.partial)?"
                         rf"{re.escape(path.suffix)}")
    if not path.parent.is_dir():
        return {}
    return {p: int(match.group(1)) for p in sorted(path.parent.iterdir())
            if (match := pattern.fullmatch(p.name)) and p.is_file()}


def earlier_video(config: PipelineConfig, source: SourceConfig) -> list[Path]:
    """The video an earlier run of file ``source`` left cut short, which this run does not
    continue as it writes none (``output.video: null``): ``NAME.partial.mp4`` and the parts of
    resumed runs, ``NAME.from-FRAME.partial.mp4``, under the default name (another name an
    earlier run's ``output.video`` gave is not known), in name order. None when this run
    writes video (its sink continues them)."""
    if config.output.video is not None:
        return []
    base = config.output_path(EARLIER_VIDEO, source.name)
    found = [partial_path(base)] if partial_path(base).is_file() else []
    return found + [part for part in video_parts(base)
                    if part.name.endswith(f".partial{base.suffix}")]


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


def last_record_pts(jsonl_path: Path) -> float | None:
    """The ``"pts"`` of the last complete record of ``jsonl_path``'s partial twin (as
    ``resume_point`` reads it), or None when there is none (or it has no pts)."""
    partial = partial_path(jsonl_path)
    line = cut_torn_line(partial) if partial.exists() else None
    try:
        pts = json.loads(line)["pts"] if line is not None else None
        return float(pts) if pts is not None else None
    except (ValueError, KeyError, TypeError):
        return None


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
    (a ``.partial`` JSONL file with records): the frame after its last record. Logs each;
    warns once of the records whose settings could not be checked (``check_settings``), and of
    each earlier run's video this run does not continue (``earlier_video``).

    Raises:
        ValueError: a ``.partial`` JSONL file whose last line is not a record (not ours), or
            whose records came from another file (``check_origin``) or were made with another
            model or other settings (``check_settings``).
    """
    files = [s for s in config.sources if not s.is_live and not is_stream_url(s.uri)]
    cut = {}
    unchecked: dict[str, list[str]] = {}  # why -> the records files
    for old, moved in zip(files, resumed_sources(config, [s.name for s in files])):
        if moved.start_frame > old.start_frame:
            jsonl_path = config.output_path(config.output.jsonl, old.name)
            check_origin(old, jsonl_path, moved.start_frame)
            why = check_settings(config, old, jsonl_path, moved.start_frame)
            if why is not None:
                unchecked.setdefault(why, []).append(str(partial_path(jsonl_path)))
            cut[old.name] = moved.start_frame
            log.info("resuming a file cut short after its last record", source=old.name,
                     from_frame=moved.start_frame)
            if video := earlier_video(config, old):
                log.warning("an earlier run's video of this file is kept as it was and not "
                            "continued: output.video is null, so this run writes no video",
                            source=old.name, paths=[str(path) for path in video])
    for why, paths in unchecked.items():
        log.warning("resuming records whose model and detection settings could not be "
                    f"checked: {why}; if they changed, the file mixes records of both "
                    "(--restart starts over)", files=paths)
    return cut
