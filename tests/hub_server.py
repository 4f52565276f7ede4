"""A small Hub-compatible HTTP server for the tests: the part of the Hub API that huggingface_hub and
transformers call for `create_repo`, `push_to_hub`, `upload_folder`, `hf_hub_download`, `snapshot_download` and
`from_pretrained` (see ../shared/HUB_API.md).

Repos live in memory. Every commit gets a sha; branches point at commits; a revision is a branch name or a
commit sha. Uploads always use the "regular" mode (file bytes base64 inside the commit body), so no LFS or Xet
endpoint is needed.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class Commit:
    sha: str
    files: dict[str, bytes]
    message: str


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        revision = unquote(revision)
        sha = self.branches.get(revision, revision)
        return self.commits.get(sha)


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubState:
    def __init__(self):
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lock = threading.Lock()
        self.requests: list[str] = []

    def repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, "RepoNotFound", f"Repository Not Found for url: {repo_type}s/{repo_id}.")
        return repo

    def commit(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    def add_commit(self, repo: Repo, branch: str, files: dict[str, bytes], message: str) -> Commit:
        sha = hashlib.sha1(f"{repo.repo_id}:{len(repo.commits)}:{message}".encode()).hexdigest()
        commit = Commit(sha, files, message)
        repo.commits[sha] = commit
        repo.branches[branch] = sha
        return commit


class HubHandler(BaseHTTPRequestHandler):
    server: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # keep the test output clean
        pass

    # --- plumbing --------------------------------------------------------------------------------------

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else b""
        if self.headers.get("Content-Encoding") == "gzip":
            data = gzip.decompress(data)
        return data

    def _send(self, status: int, payload=None, headers: dict | None = None, body: bytes | None = None):
        if body is None:
            body = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        content_type = "application/json" if payload is not None else "application/octet-stream"
        self.send_header("Content-Type", content_type)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _dispatch(self):
        state = self.server.state
        path = urlsplit(self.path).path
        state.requests.append(f"{self.command} {path}")
        try:
            with state.lock:
                self._route(state, path)
        except HubError as error:
            headers = {"X-Error-Message": error.message}
            if error.code:
                headers["X-Error-Code"] = error.code
            self._send(error.status, {"error": error.message}, headers)

    do_GET = do_HEAD = do_POST = do_DELETE = do_PUT = _dispatch

    # --- routes ----------------------------------------------------------------------------------------

    def _route(self, state: HubState, path: str):
        base = self.server.url
        if self.command == "POST" and path == "/api/repos/create":
            return self._create_repo(state, base)
        if self.command == "DELETE" and path == "/api/repos/delete":
            body = json.loads(self._body() or b"{}")
            repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
            state.repos.pop((body.get("type") or "model", repo_id), None)
            return self._send(200, {})
        if path == "/api/validate-yaml":
            self._body()
            return self._send(200, {"errors": [], "warnings": []})
        match = re.fullmatch(r"/api/(model|dataset)s/(.+?)/(preupload|commit|branch|tree)/(.+)", path)
        if match:
            repo_type, repo_id, action, rest = match.groups()
            repo = state.repo(repo_type, repo_id)
            return getattr(self, f"_{action}")(state, repo, unquote(rest))
        match = re.fullmatch(r"/api/(model|dataset)s/(.+?)(?:/revision/(.+))?", path)
        if match and self.command == "GET":
            repo_type, repo_id, revision = match.groups()
            return self._info(state, state.repo(repo_type, repo_id), unquote(revision or "main"))
        match = re.fullmatch(r"/(datasets/)?(.+?)/resolve/([^/]+)/(.+)", path)
        if match and self.command in ("GET", "HEAD"):
            dataset, repo_id, revision, filename = match.groups()
            return self._resolve(state, "dataset" if dataset else "model", repo_id, revision, unquote(filename))
        raise HubError(404, None, f"{self.command} {path} is not served by the test Hub.")

    def _create_repo(self, state: HubState, base: str):
        body = json.loads(self._body() or b"{}")
        repo_type = body.get("type") or "model"
        repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
        url = f"{base}/{repo_id}" if repo_type == "model" else f"{base}/{repo_type}s/{repo_id}"
        if (repo_type, repo_id) in state.repos:
            return self._send(409, {"error": "You already created this repo", "url": url})
        private = bool(body.get("private")) or body.get("visibility") == "private"
        repo = state.repos[(repo_type, repo_id)] = Repo(repo_id, repo_type, private)
        state.add_commit(repo, "main", {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"},
                         "initial commit")
        return self._send(200, {"url": url, "name": repo_id})

    def _info(self, state: HubState, repo: Repo, revision: str):
        commit = state.commit(repo, revision)
        return self._send(200, {
            "id": repo.repo_id, "modelId": repo.repo_id, "sha": commit.sha, "private": repo.private,
            "siblings": [{"rfilename": name, "size": len(data)} for name, data in sorted(commit.files.items())],
            "tags": [], "disabled": False, "gated": False, "downloads": 0, "likes": 0,
        })

    def _tree(self, state: HubState, repo: Repo, rest: str):
        revision, _, folder = rest.partition("/")
        commit = state.commit(repo, revision)
        prefix = f"{folder.rstrip('/')}/" if folder else ""
        entries, folders = [], set()
        for name, data in sorted(commit.files.items()):
            if not name.startswith(prefix):
                continue
            relative = name[len(prefix):]
            if "/" in relative:
                folders.add(prefix + relative.split("/")[0])
                if "recursive=true" not in self.path.lower() and "recursive=1" not in self.path:
                    continue
            entries.append({"type": "file", "oid": _git_blob_sha(data), "size": len(data), "path": name})
        entries += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": f} for f in sorted(folders)]
        if folder and not entries:
            raise HubError(404, "EntryNotFound", f"{folder} does not exist on {revision}")
        return self._send(200, entries)

    def _preupload(self, state: HubState, repo: Repo, revision: str):
        body = json.loads(self._body() or b"{}")
        commit = repo.resolve(revision)
        current = commit.files if commit else {}
        files = [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
             "oid": _git_blob_sha(current[f["path"]]) if f["path"] in current else None}
            for f in body.get("files", [])
        ]
        return self._send(200, {"files": files, "commitOid": commit.sha if commit else None})

    def _commit(self, state: HubState, repo: Repo, revision: str):
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        parent = repo.resolve(revision)
        if parent is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = dict(parent.files)
        message = "commit"
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "header":
                message = value.get("summary") or message
            elif key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                files.pop(value["path"], None)
            elif key == "deletedFolder":
                folder = value["path"].rstrip("/") + "/"
                files = {k: v for k, v in files.items() if not k.startswith(folder)}
            else:
                raise HubError(400, None, f"The test Hub does not take {key!r} commit lines (use regular uploads).")
        branch = revision if revision in repo.branches else "main"
        commit = state.add_commit(repo, branch, files, message)
        return self._send(200, {
            "commitOid": commit.sha, "commitUrl": f"{self.server.url}/{repo.repo_id}/commit/{commit.sha}",
            "pullRequestUrl": None,
        })

    def _branch(self, state: HubState, repo: Repo, branch: str):
        body = json.loads(self._body() or b"{}")
        if branch in repo.branches:
            raise HubError(409, None, f"Branch {branch} already exists")
        start = state.commit(repo, body.get("startingPoint") or "main")
        repo.branches[branch] = start.sha
        return self._send(200, {})

    def _resolve(self, state: HubState, repo_type: str, repo_id: str, revision: str, filename: str):
        repo = state.repo(repo_type, repo_id)
        commit = state.commit(repo, revision)
        data = commit.files.get(filename)
        if data is None:
            raise HubError(404, "EntryNotFound", f"{filename} does not exist on {revision}")
        headers = {"X-Repo-Commit": commit.sha, "ETag": f'"{_git_blob_sha(data)}"'}
        return self._send(200, headers=headers, body=data)


class HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.state = HubState()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()
