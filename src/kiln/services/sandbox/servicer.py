"""gRPC servicer of `kiln.v1.Sandbox`: translates protobuf to `SessionManager` calls and back.

Errors map to status codes: an unknown session or file NOT_FOUND; bad input (a malformed task,
a path leaving the workspace) INVALID_ARGUMENT; a full service RESOURCE_EXHAUSTED (retry
later); a retryable sandbox failure UNAVAILABLE; other sandbox failures INTERNAL. No logic
lives here.
"""
from __future__ import annotations

import json

import grpc

from kiln.protos.kiln.v1 import sandbox_pb2, sandbox_pb2_grpc

from kiln.services.sandbox.interface import PathEscapeError, SandboxError, WorkspaceFull
from kiln.services.sandbox.sessions import CapacityError, SessionManager, SessionNotFound
from kiln.services.sandbox.wire import limits_from_proto


def _task(text: str) -> dict | None:
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"task_json: not valid JSON ({exc.msg})") from None

# The most one ReadFile returns (a caller asking for more, or for 0 = no limit, gets this).
READ_LIMIT_BYTES = 16 << 20


class SandboxServicer(sandbox_pb2_grpc.SandboxServicer):
    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager

    async def _call(self, context, coro):
        try:
            return await coro
        except SessionNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        except (CapacityError, WorkspaceFull) as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except (PathEscapeError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except FileNotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"path: {exc}")
        except SandboxError as exc:
            code = grpc.StatusCode.UNAVAILABLE if exc.retryable else grpc.StatusCode.INTERNAL
            await context.abort(code, str(exc))

    async def CreateSession(self, request, context):
        async def go():
            limits = (limits_from_proto(request.limits, self.manager.base.limits)
                      if request.HasField("limits") else None)
            s = await self.manager.create(request.owner, image=request.image or None,
                                          limits=limits, ttl_s=request.ttl_seconds or None,
                                          task=_task(request.task_json))
            return sandbox_pb2.SessionInfo(session_id=s.id, sandbox_name=s.sandbox.name,
                                           task_id=s.task.id if s.task else "")
        return await self._call(context, go())

    async def Exec(self, request, context):
        async def go():
            session = self.manager.get(request.session_id)
            which = request.WhichOneof("command")
            if which is None:
                raise ValueError("command: set shell or argv")
            cmd = request.shell if which == "shell" else list(request.argv.args)
            # The job's timeout bounds every exec; a caller may only ask for less.
            limit = session.sandbox.limits.timeout_seconds
            r = await session.sandbox.exec(cmd, timeout=min(request.timeout_seconds or limit, limit),
                                           workdir=request.workdir or None,
                                           env=dict(request.env) or None,
                                           stdin=request.stdin or None)
            session.touch()
            return sandbox_pb2.ExecResponse(
                exit_code=r.exit_code, stdout=r.stdout, stderr=r.stderr, timed_out=r.timed_out,
                oom_killed=r.oom_killed, truncated=r.truncated, duration_seconds=r.duration_s)
        return await self._call(context, go())

    async def ReadFile(self, request, context):
        async def go():
            session = self.manager.get(request.session_id)
            # Finite by default: a reply is held in memory whole (and must fit a gRPC message).
            data = await session.sandbox.read_file(request.path, min(request.max_bytes or READ_LIMIT_BYTES,
                                                                     READ_LIMIT_BYTES))
            return sandbox_pb2.ReadFileResponse(data=data)
        return await self._call(context, go())

    async def WriteFile(self, request, context):
        async def go():
            session = self.manager.get(request.session_id)
            await session.sandbox.write_file(request.path, request.data, request.mode or 0o644)
            return sandbox_pb2.WriteFileResponse()
        return await self._call(context, go())

    async def Verify(self, request, context):
        async def go():
            r = await self.manager.verify(request.session_id, _task(request.task_json),
                                          request.answer if request.has_answer else None)
            return sandbox_pb2.VerifyResponse(reward=r.reward, parts=r.parts, output=r.output,
                                              flags=r.flags)
        return await self._call(context, go())

    async def DestroySession(self, request, context):
        async def go():
            return sandbox_pb2.DestroySessionResponse(
                destroyed=await self.manager.destroy(request.session_id))
        return await self._call(context, go())
