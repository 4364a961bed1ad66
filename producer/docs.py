"""``GET /docs``: Swagger UI over the gateway's own ``/openapi.json``, where FastAPI and BentoML
users look first.

The page and every asset it loads are served by the gateway from the ``swagger-ui-bundle``
package, so the page works where the browser reaches nothing but the gateway (no CDN). The
assets are a fixed list of that package's files: a path names one of them or is a 404, never a
file elsewhere. URLs in the page are relative, so it also works behind a proxy that mounts the
gateway under a prefix.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response
from starlette.routing import Route
from swagger_ui_bundle import swagger_ui_path

from producer.errors import NotFound

ASSETS = {
    "swagger-ui.css": "text/css",
    "swagger-ui-bundle.js": "text/javascript",
    "favicon-32x32.png": "image/png",
}
"""The files of the Swagger UI bundle the page loads, with their media types."""

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>inferq: Open Inference Protocol API</title>
  <link rel="stylesheet" href="docs/swagger-ui.css">
  <link rel="icon" type="image/png" href="docs/favicon-32x32.png">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="docs/swagger-ui-bundle.js"></script>
  <script>
    window.ui = SwaggerUIBundle({
      url: "openapi.json",
      dom_id: "#swagger-ui",
      presets: [SwaggerUIBundle.presets.apis],
      layout: "BaseLayout",
    });
  </script>
</body>
</html>
"""


async def page(request: Request) -> Response:
    return HTMLResponse(PAGE)


async def asset(request: Request) -> Response:
    name = request.path_params["asset"]
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"no such file: /docs/{name}")
    return FileResponse(
        str(swagger_ui_path / name),
        media_type=media_type,
        headers={"cache-control": "public, max-age=86400"},
    )


def routes() -> list[Route]:
    """The page and its assets, for the gateway's route table (not in the OpenAPI document)."""
    return [
        Route("/docs", page, name="docs"),
        Route("/docs/{asset}", asset, name="docs_asset"),
    ]
