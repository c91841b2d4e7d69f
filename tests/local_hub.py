"""A Hugging Face Hub on 127.0.0.1 for the tests: a stdlib HTTP server that answers what huggingface_hub 2.4,
transformers 5.24 and datasets 5.2 ask of the Hub, from repos the tests build in memory. Point a script at it with
HF_ENDPOINT=hub.endpoint (and a fresh HF_HOME); every request it gets is logged in `hub.requests` as
(method, route, path).

Routes (a repo id is `name` or `namespace/name`; `{type}` is `model` or `dataset`; `{rev}` a branch, a ref such as
`refs/convert/parquet` sent as one segment `refs%2Fconvert%2Fparquet`, or a revision's 40-hex sha):
    HEAD/GET {repo}/resolve/{rev}/{path}, datasets/{repo}/resolve/{rev}/{path}
                                                a file (GET honours `Range: bytes=N-`, as a resumed download sends)
    GET api/{type}s/{repo}                      repo info at main: id, sha, siblings
    GET api/{type}s/{repo}/revision/{rev}       repo info at a revision
    GET api/{type}s/{repo}/tree/{rev}[/{path}]  a folder's files and folders, `?recursive=true` for all below it
    GET api/agent-harnesses                     huggingface_hub's registry of AI agents, for its user agent: empty
    GET api/whoami-v2                           the user of a valid token
    POST api/repos/create                       a new model repo (409 if it exists)
    POST api/{type}s/{repo}/preupload/{rev}     every file "regular" (inline in the commit, no LFS)
    POST api/{type}s/{repo}/commit/{rev}        an NDJSON commit of base64 files: a new revision of the branch
Headers as the Hub's: X-Repo-Commit, ETag and Content-Length on every 200 and 206 (HEAD too); for a file the Hub
keeps in LFS (.parquet, .safetensors, .bin) the ETag is its sha256, also sent as X-Linked-Etag with X-Linked-Size.
Errors as the Hub's: an unknown repo is 401 `X-Error-Code: RepoNotFound`, an unknown revision 404 `RevisionNotFound`,
a missing file or folder 404 `EntryNotFound`, a token the server does not know 401 "Invalid credentials in
Authorization header" on every route; a route the server does not know is 404 without a code (and logged as
"unknown", so a test sees a client asking something new).

Failures on demand: `hub.gone_after(path, n)` makes the next GET of a file send its first n bytes and then stop the
whole server, as a Hub that goes away mid-download; `hub.start()` brings it back on the same port.
"""

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".parquet", ".safetensors", ".bin")
ACTIONS = ("resolve", "revision", "tree", "preupload", "commit")
USER = "tester"


def git_blob_sha(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Repo:
    """A repo: each revision (a branch or ref name) maps file paths to their bytes."""

    revisions: dict[str, dict[str, bytes]]

    def sha(self, revision: str) -> str:
        """A stable 40-hex commit id per revision: the same files give the same sha in every session."""
        digest = hashlib.sha1(revision.encode())
        for path, content in sorted(self.revisions[revision].items()):
            digest.update(f"{path}\0{git_blob_sha(content)}\0".encode())
        return digest.hexdigest()

    def revision(self, name: str) -> Optional[str]:
        """The revision a name or a sha stands for, or None."""
        if name in self.revisions:
            return name
        return next((revision for revision in self.revisions if self.sha(revision) == name), None)


@dataclass
class LocalHub:
    repos: dict[tuple[str, str], Repo] = field(default_factory=dict)  # (type, repo id) -> Repo
    tokens: set = field(default_factory=lambda: {"hf_local_test_token"})
    requests: list = field(default_factory=list)  # (method, route, path) of every request, in order
    resumed: list = field(default_factory=list)  # (path, first byte) of every GET with a Range header
    server: Optional[ThreadingHTTPServer] = None
    port: int = 0
    cut: dict = field(default_factory=dict)  # path -> bytes sent before the server goes away

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, kind: str, repo_id: str, files: dict[str, bytes], revision: str = "main") -> None:
        repo = self.repos.setdefault((kind, repo_id), Repo({}))
        repo.revisions[revision] = {path: bytes(content) for path, content in files.items()}

    def start(self) -> "LocalHub":
        handler = type("Handler", (HubHandler,), {"hub": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            server.shutdown()
            server.server_close()

    def gone_after(self, path: str, nbytes: int) -> None:
        self.cut[path] = nbytes


class HubError(Exception):
    def __init__(self, status: int, code: Optional[str], message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class HubHandler(BaseHTTPRequestHandler):
    hub: LocalHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # quiet: the tests read hub.requests
        pass

    def do_HEAD(self):
        self.answer("HEAD")

    def do_GET(self):
        self.answer("GET")

    def do_POST(self):
        self.answer("POST")

    # -- routing -------------------------------------------------------------------------------------------------------
    def answer(self, method: str) -> None:
        url = urlsplit(self.path)
        # split the raw path before unquoting: `refs%2Fconvert%2Fparquet` is one segment, a revision
        segments = [unquote(segment) for segment in url.path.strip("/").split("/")]
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else b""
        route = "unknown"
        try:
            route, handler, arguments = self.route(method, segments)
            self.hub.requests.append((method, route, self.path))
            self.check_token()
            handler(method, *arguments, query=query, body=body)
        except HubError as error:
            if route == "unknown":
                self.hub.requests.append((method, route, self.path))
            headers = {"X-Error-Message": error.message, **({"X-Error-Code": error.code} if error.code else {})}
            self.send(error.status, json.dumps({"error": error.message}).encode(), method, headers)

    def route(self, method: str, segments: list[str]):
        if segments[:2] == ["api", "agent-harnesses"] and method == "GET":
            return "api/agent-harnesses", self.agent_harnesses, ()
        if segments[:2] == ["api", "whoami-v2"] and method == "GET":
            return "api/whoami-v2", self.whoami, ()
        if segments[:3] == ["api", "repos", "create"] and method == "POST":
            return "api/repos/create", self.create_repo, ()
        if segments[0] == "api" and len(segments) >= 3 and segments[1] in ("models", "datasets"):
            kind, rest = segments[1][:-1], segments[2:]
            repo_id, action, rest = self.split_repo(rest)
            if action is None and method == "GET":
                return "api/{type}s/{repo}", self.repo_info, (kind, repo_id, "main")
            if action == "revision" and len(rest) == 1 and method == "GET":
                return "api/{type}s/{repo}/revision/{rev}", self.repo_info, (kind, repo_id, rest[0])
            if action == "tree" and rest and method == "GET":
                path = "/".join(rest[1:])
                return (
                    "api/{type}s/{repo}/tree/{rev}" + ("/{path}" if path else ""),
                    self.tree,
                    (kind, repo_id, rest[0], path),
                )
            if action == "preupload" and len(rest) == 1 and method == "POST":
                return "api/{type}s/{repo}/preupload/{rev}", self.preupload, (kind, repo_id, rest[0])
            if action == "commit" and len(rest) == 1 and method == "POST":
                return "api/{type}s/{repo}/commit/{rev}", self.commit, (kind, repo_id, rest[0])
        elif method in ("HEAD", "GET"):
            kind, rest = ("dataset", segments[1:]) if segments[0] == "datasets" else ("model", segments)
            repo_id, action, rest = self.split_repo(rest)
            if action == "resolve" and len(rest) >= 2:
                prefix = "datasets/" if kind == "dataset" else ""
                return (
                    prefix + "{repo}/resolve/{rev}/{path}",
                    self.resolve,
                    (kind, repo_id, rest[0], "/".join(rest[1:])),
                )
        raise HubError(404, None, "Sorry, we can't find the page you are looking for.")

    @staticmethod
    def split_repo(rest: list[str]):
        """(repo id, action, what follows the action): `gpt2/resolve/...` or `namespace/name/tree/...`."""
        if len(rest) >= 2 and rest[1] in ACTIONS:
            return rest[0], rest[1], rest[2:]
        return "/".join(rest[:2]), (rest[2] if len(rest) > 2 else None), rest[3:]

    # -- helpers -------------------------------------------------------------------------------------------------------
    def check_token(self) -> None:
        authorization = self.headers.get("Authorization")
        if authorization and authorization.removeprefix("Bearer ") not in self.hub.tokens:
            raise HubError(401, None, "Invalid credentials in Authorization header")

    def authorized(self) -> bool:
        authorization = self.headers.get("Authorization") or ""
        return authorization.removeprefix("Bearer ") in self.hub.tokens

    def find(self, kind: str, repo_id: str, revision: str) -> tuple[Repo, str]:
        repo = self.hub.repos.get((kind, repo_id))
        if repo is None:
            raise HubError(401, "RepoNotFound", "Repository not found")
        name = repo.revision(revision)
        if name is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo, name

    def send(self, status: int, content: bytes, method: str, headers: dict, length: Optional[int] = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(content) if length is None else length))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(content)

    def send_json(self, value, method: str, headers: Optional[dict] = None) -> None:
        content = json.dumps(value).encode()
        etag = f'"{hashlib.sha1(content).hexdigest()}"'
        self.send(200, content, method, {"Content-Type": "application/json", "ETag": etag, **(headers or {})})

    # -- read routes ---------------------------------------------------------------------------------------------------
    def resolve(self, method, kind, repo_id, revision, path, **_):
        repo, name = self.find(kind, repo_id, revision)
        files = repo.revisions[name]
        if path not in files:
            raise HubError(404, "EntryNotFound", f'{path} does not exist on "{revision}"')
        content = files[path]
        headers = {
            "X-Repo-Commit": repo.sha(name),
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if path.endswith(LFS_SUFFIXES):
            sha256 = hashlib.sha256(content).hexdigest()
            headers.update({"ETag": f'"{sha256}"', "X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(content))})
        else:
            headers["ETag"] = f'"{git_blob_sha(content)}"'
        start = 0
        if method == "GET" and self.headers.get("Range", "").startswith("bytes="):
            start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
            self.hub.resumed.append((path, start))
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(content) - 1}/{len(content)}"
        cut = self.hub.cut.pop(path, None) if method == "GET" else None
        if cut is None:
            return self.send(status, content[start:], method, headers)
        # the Hub goes away mid-download: headers and the first `cut` bytes, then nothing listens any more
        self.send_response(status)
        self.send_header("Content-Length", str(len(content) - start))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(content[start : start + cut])
        self.wfile.flush()
        self.hub.stop()
        self.close_connection = True

    def repo_info(self, method, kind, repo_id, revision, **_):
        repo, name = self.find(kind, repo_id, revision)
        sha = repo.sha(name)
        info = {"_id": sha[:24], "id": repo_id, "author": repo_id.split("/")[0], "sha": sha, "private": False,
                "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                "lastModified": "2024-01-01T00:00:00.000Z", "createdAt": "2024-01-01T00:00:00.000Z",
                "siblings": [{"rfilename": path} for path in sorted(repo.revisions[name])]}  # fmt: skip
        if kind == "model":
            info["modelId"] = repo_id
        self.send_json(info, method, {"X-Repo-Commit": sha})

    def tree(self, method, kind, repo_id, revision, path, query, **_):
        repo, name = self.find(kind, repo_id, revision)
        files = repo.revisions[name]
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        below = sorted(p for p in files if p.startswith(prefix))
        if prefix and not below:
            raise HubError(404, "EntryNotFound", f'{path} does not exist on "{revision}"')
        recursive = query.get("recursive", "false").lower() in ("true", "1")
        entries, folders = [], set()
        for file_path in below:
            parts = file_path[len(prefix) :].split("/")
            for depth in range(1, len(parts) if recursive else min(len(parts), 2)):
                folders.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                content = files[file_path]
                entry = {"type": "file", "oid": git_blob_sha(content), "size": len(content), "path": file_path}
                if file_path.endswith(LFS_SUFFIXES):
                    entry["lfs"] = {
                        "oid": hashlib.sha256(content).hexdigest(),
                        "size": len(content),
                        "pointerSize": 134,
                    }
                entries.append(entry)
        entries += [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
                    for f in sorted(folders)]  # fmt: skip
        self.send_json(entries, method, {"X-Repo-Commit": repo.sha(name)})

    def agent_harnesses(self, method, **_):
        self.send_json({"standardEnvVars": [], "harnesses": {}}, method)

    # -- upload routes -------------------------------------------------------------------------------------------------
    def whoami(self, method, **_):
        if not self.authorized():
            raise HubError(401, None, "Invalid credentials in Authorization header")
        self.send_json({"type": "user", "name": USER, "fullname": USER, "auth": {"type": "access_token"}}, method)

    def create_repo(self, method, body, **_):
        if not self.authorized():
            raise HubError(401, None, "Invalid credentials in Authorization header")
        payload = json.loads(body)
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        kind = payload.get("type") or "model"
        if (kind, repo_id) in self.hub.repos:
            raise HubError(409, None, "You already created this model repo")
        self.hub.add(kind, repo_id, {})
        self.send_json({"url": f"{self.hub.endpoint}/{repo_id}", "name": repo_id}, method)

    def preupload(self, method, kind, repo_id, revision, body, **_):
        self.find(kind, repo_id, revision)
        files = json.loads(body)["files"]
        self.send_json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                  for f in files]}, method)  # fmt: skip

    def commit(self, method, kind, repo_id, revision, body, **_):
        repo, name = self.find(kind, repo_id, revision)
        files = dict(repo.revisions[name])
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "file":
                files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            elif item["key"] != "header":
                raise HubError(400, None, f"this local Hub takes regular files only, not {item['key']}")
        repo.revisions[name] = files
        sha = repo.sha(name)
        self.send_json({"commitUrl": f"{self.hub.endpoint}/{repo_id}/commit/{sha}", "commitOid": sha}, method)
