"""Runs: begin, end and interrupt (docs/contract.md §2.10, 3.2)."""

from __future__ import annotations

import falcon

from .common import Resource, json_body, model_field, send_json


class BeginRun(Resource):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        run = self.service.begin_run(model_field(json_body(req)))
        send_json(resp, {"run": run.run_id, "idle_s": float(self.service.idle_s)})


class EndRun(Resource):
    def on_post(self, req: falcon.Request, resp: falcon.Response, run: str) -> None:
        # The body is ignored (docs/contract.md §2.10); the front gate refused one not JSON.
        send_json(resp, {"run": run, "ended": self.service.end_run(run)})


class Interrupt(Resource):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        count = self.service.interrupt(json_body(req).get("run"))
        send_json(resp, {"interrupted": count})
