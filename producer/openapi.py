"""The OpenAPI 3 description of the gateway's HTTP API, served at ``GET /openapi.json``.

Written by hand from the Open Inference Protocol (KServe V2) REST specification plus inferq's
async-jobs extension; the fuzz tests generate requests from it and check that no input makes the
gateway answer 5xx or hang.
"""

from __future__ import annotations

from typing import Any

import runtime
from protocol.tensor import DATATYPES

_ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}


def _errors(*codes: int) -> dict[str, Any]:
    reasons = {
        400: "invalid request (a readable message says what)",
        401: "no admin token sent (model-control API)",
        403: "wrong admin token, or the model-control API is disabled",
        404: "unknown model, version, job or endpoint",
        409: "the job has already started or finished; or another load of the model is running",
        413: "request body too large",
        415: "unsupported Content-Type or Content-Encoding",
        429: "overloaded or backlog full; see Retry-After",
        500: "the model failed",
        503: "no live worker, Redis unreachable, or the model's breaker is open; see Retry-After",
        504: "the request's deadline passed",
    }
    return {
        str(c): {
            "description": reasons[c],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for c in codes
    }


def _json(ref: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}},
    }


def _params(*names: str) -> list[dict[str, Any]]:
    return [
        {"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names
    ]


def document() -> dict[str, Any]:
    tensor = {
        "type": "object",
        "required": ["name", "datatype", "shape"],
        "properties": {
            "name": {"type": "string"},
            "datatype": {"type": "string", "enum": sorted(DATATYPES)},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "data": {"type": "array", "items": {}},
            "parameters": {"type": "object"},
        },
    }
    schemas = {
        "Error": _ERROR,
        "InferInput": tensor,
        "InferRequest": {
            "type": "object",
            "required": ["inputs"],
            "properties": {
                "id": {"type": "string"},
                "parameters": {
                    "type": "object",
                    "properties": {
                        "timeout": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "deadline in microseconds",
                        },
                        "priority": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "1 highest; 0 default; 2+ low",
                        },
                        "cache": {"type": "boolean"},
                        "binary_data_output": {"type": "boolean"},
                    },
                },
                "inputs": {"type": "array", "items": {"$ref": "#/components/schemas/InferInput"}},
                "outputs": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string"},
                            "parameters": {"type": "object"},
                        },
                    },
                },
            },
        },
        "InferResponse": {
            "type": "object",
            "required": ["model_name", "outputs"],
            "properties": {
                "id": {"type": "string"},
                "model_name": {"type": "string"},
                "model_version": {"type": "string"},
                "outputs": {"type": "array", "items": {"type": "object"}},
            },
        },
        "ModelMetadata": {
            "type": "object",
            "required": ["name", "versions", "platform", "inputs", "outputs"],
            "properties": {
                "name": {"type": "string"},
                "versions": {"type": "array", "items": {"type": "string"}},
                "platform": {"type": "string"},
                "inputs": {"type": "array", "items": {"type": "object"}},
                "outputs": {"type": "array", "items": {"type": "object"}},
            },
        },
        "Job": {
            "type": "object",
            "required": ["id", "model_name", "status"],
            "properties": {
                "id": {"type": "string"},
                "model_name": {"type": "string"},
                "model_version": {"type": "string"},
                "status": {
                    "type": "string",
                    "enum": ["queued", "running", "succeeded", "failed", "expired", "cancelled"],
                },
                "created_at": {"type": "string", "nullable": True},
                "started_at": {"type": "string", "nullable": True},
                "finished_at": {"type": "string", "nullable": True},
                "result": {"$ref": "#/components/schemas/InferResponse"},
                "error": {"type": "string"},
            },
        },
    }
    infer_body = {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/InferRequest"}},
        },
    }
    health = {"type": "object"}
    paths: dict[str, Any] = {
        "/v2/health/live": {
            "get": {
                "summary": "Liveness",
                "responses": {
                    "200": {
                        "description": "live",
                        "content": {"application/json": {"schema": health}},
                    }
                },
            }
        },
        "/v2/health/ready": {
            "get": {
                "summary": "Readiness",
                "responses": {
                    "200": {
                        "description": "ready",
                        "content": {"application/json": {"schema": health}},
                    },
                    "503": {
                        "description": "not ready",
                        "content": {"application/json": {"schema": health}},
                    },
                },
            }
        },
        "/v2": {
            "get": {
                "summary": "Server metadata",
                "responses": {
                    "200": {
                        "description": "name, version and extensions",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            }
        },
        "/v2/jobs/{job}": {
            "parameters": _params("job"),
            "get": {
                "summary": "A job, long-polled with ?wait=",
                "parameters": [
                    {
                        "name": "wait",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "number", "minimum": 0, "maximum": 1},
                    }
                ],
                "responses": {"200": _json("Job", "the job"), **_errors(400, 404, 503)},
            },
            "delete": {
                "summary": "Cancel a job that has not started",
                "responses": {"200": _json("Job", "the cancelled job"), **_errors(404, 409, 503)},
            },
        },
    }
    for base, names in (
        ("/v2/models/{model}", ("model",)),
        ("/v2/models/{model}/versions/{version}", ("model", "version")),
    ):
        paths[base] = {
            "parameters": _params(*names),
            "get": {
                "summary": "Model metadata",
                "responses": {"200": _json("ModelMetadata", "metadata"), **_errors(404)},
            },
        }
        paths[base + "/ready"] = {
            "parameters": _params(*names),
            "get": {
                "summary": "Model readiness",
                "responses": {
                    "200": {"description": "ready"},
                    "503": {"description": "not ready"},
                    **_errors(404),
                },
            },
        }
        paths[base + "/infer"] = {
            "parameters": _params(*names),
            "post": {
                "summary": "Inference (JSON, or the binary tensor extension)",
                "requestBody": infer_body,
                "responses": {
                    "200": _json("InferResponse", "outputs"),
                    **_errors(400, 404, 413, 415, 429, 500, 503, 504),
                },
            },
        }
        paths[base + "/jobs"] = {
            "parameters": _params(*names),
            "post": {
                "summary": "Submit an async job",
                "requestBody": infer_body,
                "parameters": [
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "required": False,
                        "schema": {"type": "string"},
                    }
                ],
                "responses": {
                    "202": _json("Job", "queued"),
                    **_errors(400, 404, 413, 415, 429, 503),
                },
            },
        }
    admin: list[dict[str, list[str]]] = [{"adminToken": []}]
    load_body = {
        "required": False,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "parameters": {
                            "type": "object",
                            "description": "'version' (serve only that version) or 'weights' "
                            "(version -> relative share of requests that name no version); "
                            "neither: as the repository config says",
                            "properties": {
                                "version": {"type": "string"},
                                "weights": {
                                    "type": "object",
                                    "additionalProperties": {"type": "number", "minimum": 0},
                                },
                            },
                        }
                    },
                }
            }
        },
    }
    paths["/v2/repository/index"] = {
        "post": {
            "summary": "Every model version and its state (Triton's repository index)",
            "security": admin,
            "requestBody": {
                "required": False,
                "content": {
                    "application/json": {
                        "schema": {"type": "object", "properties": {"ready": {"type": "boolean"}}}
                    }
                },
            },
            "responses": {
                "200": {
                    "description": "name, version, state (READY or UNAVAILABLE), reason, traffic",
                    "content": {
                        "application/json": {
                            "schema": {"type": "array", "items": {"type": "object"}}
                        }
                    },
                },
                **_errors(400, 401, 403, 503),
            },
        }
    }
    paths["/v2/repository/models/{model}/load"] = {
        "parameters": _params("model"),
        "post": {
            "summary": "Load versions on every worker, warm them, then switch traffic",
            "security": admin,
            "requestBody": load_body,
            "responses": {
                "200": {"description": "the committed policy and each worker's load time"},
                **_errors(400, 401, 403, 404, 409, 503),
            },
        },
    }
    paths["/v2/repository/models/{model}/unload"] = {
        "parameters": _params("model"),
        "post": {
            "summary": "Unload the model, or one version with {'parameters': {'version': v}}",
            "security": admin,
            "requestBody": load_body,
            "responses": {
                "200": {"description": "the policy left"},
                **_errors(400, 401, 403, 404, 409, 503),
            },
        },
    }
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "inferq",
            "version": runtime.__version__,
            "description": "Open Inference Protocol (KServe V2) over Redis Streams, "
            "with async jobs.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer"}},
        },
    }
