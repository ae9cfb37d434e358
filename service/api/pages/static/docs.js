// /docs: start Swagger UI (shipped in /static/swagger-ui) on the schema the page carries.
// No inline script and no fetch of the schema: the page's CSP runs scripts from this server only,
// and the API does not take the login cookie this page was opened with.
"use strict";
window.ui = SwaggerUIBundle({
  spec: JSON.parse(document.getElementById("openapi-schema").textContent),
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  presets: [SwaggerUIBundle.presets.apis],
  deepLinking: true,
  validatorUrl: null,
  queryConfigEnabled: false,
});
