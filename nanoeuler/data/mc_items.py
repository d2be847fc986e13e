"""Multiple-choice items from JSON lines, for `nanoeuler eval --task mc` and training's --eval-task.

    items = read_mc("items.jsonl")            # [{"context", "choices", "label", "where"}], one-line errors

An mc item is `{"context": str, "choices": [str, ...], "label": int}`, one JSON object a line; `where` ("PATH
line N") is added so that an error about the item can name its line. data/hellaswag.py reads HellaSwag's rows
into the same items with read_jsonl.
"""
import json

from nanoeuler.errors import UserError


def _open_lines(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        raise UserError(f"{path} not found") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def mc_item(record, where):
    """A checked mc item from a parsed JSON value; a UserError saying what is wrong, prefixed by `where`."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object {{\"context\", \"choices\", \"label\"}}")
    missing = [key for key in ("context", "choices", "label") if key not in record]
    if missing:
        raise UserError(f"{where}: missing {', '.join(missing)}")
    context, choices, label = record["context"], record["choices"], record["label"]
    if not isinstance(context, str):
        raise UserError(f"{where}: context must be a string")
    if (not isinstance(choices, list) or len(choices) < 2
            or not all(isinstance(c, str) and c for c in choices)):
        raise UserError(f"{where}: choices must be a list of at least 2 non-empty strings")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise UserError(f"{where}: label must be an integer index into the {len(choices)} choices, got "
                        f"{json.dumps(label)}")
    return {"context": context, "choices": choices, "label": label, "where": where}


def read_jsonl(path, convert):
    """convert(parsed line, "PATH line N") for each non-blank line; a UserError naming the line if one is not
    JSON, and one if there is no item."""
    items = []
    for n, line in enumerate(_open_lines(path), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise UserError(f"{where}: not JSON ({e.msg})") from None
        items.append(convert(record, where))
    if not items:
        raise UserError(f"{path} holds no items")
    return items


def read_mc(path):
    return read_jsonl(path, mc_item)
