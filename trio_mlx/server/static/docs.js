// /docs: Swagger UI (served from the swagger-ui-py package, no CDN) over the server's /openapi.json.
window.addEventListener("DOMContentLoaded", () => {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    displayRequestDuration: true,
    validatorUrl: null, // never ask validator.swagger.io
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
  });
});
