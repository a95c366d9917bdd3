"""/docs: Swagger UI over /openapi.json, its script and style served by this server from the
swagger-ui-bundle package rather than from a CDN, so that the page works offline. FastAPI's own
/docs and /redoc load theirs from a CDN; /redoc has no offline assets and is not served."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

ASSETS = "/docs/assets"


def add_docs_routes(app: FastAPI) -> None:
    """Call on an app made with docs_url=None and redoc_url=None."""
    title = f"{app.title} {app.version}"

    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=title,
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon-32x32.png")

    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)
    app.mount(ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs_assets")
