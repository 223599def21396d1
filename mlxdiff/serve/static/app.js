// mlxdiff's page: the job API (POST /v1/jobs), its event stream (GET /v1/jobs/{id}/events: progress with a preview,
// then done / error / cancelled) read with fetch so that an API key can ride in the Authorization header. The inputs
// a family takes (an image, a mask, the server's LoRAs) are shown as GET /v1/page-config's "takes" says; with an
// image the job goes to POST /v1/jobs/edits (multipart), else to POST /v1/jobs (JSON).
"use strict";
const $ = (id) => document.getElementById(id);
let needsKey = false;

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = $("api_key").value;
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function api(path, options) {
  const response = await fetch(path, Object.assign({}, options, {headers: headers((options || {}).headers)}));
  const body = (response.headers.get("content-type") || "").includes("json") ? await response.json() : null;
  if (!response.ok) throw new Error(body && body.error ? body.error.message : response.statusText);
  return body;
}

async function configure() {
  const config = await api("/v1/page-config");
  $("model").textContent = config.model + " (" + config.family + ")";
  $("width").value = $("height").value = config.size;
  $("steps").value = config.steps;
  $("guidance").value = config.guidance;
  const takes = config.takes;
  $("image-section").hidden = !takes.image;
  $("mask-label").hidden = !takes.mask;
  $("loras-section").hidden = takes.loras.length === 0;
  for (const name of takes.loras) {
    const row = document.createElement("label");
    row.className = "lora";
    const use = Object.assign(document.createElement("input"), {type: "checkbox", className: "lora-use", value: name});
    const scale = Object.assign(document.createElement("input"),
      {type: "number", className: "lora-scale", step: "0.05", value: "1", title: "scale"});
    row.append(use, " " + name + " ", scale);
    $("loras").append(row);
  }
  needsKey = config.api_key;
  $("key-label").hidden = !needsKey;
  $("api_key").value = localStorage.getItem("mlxdiff-api-key") || "";
}

function chosenLoras() {
  return Array.from(document.querySelectorAll("#loras .lora"))
    .filter((row) => row.querySelector(".lora-use").checked)
    .map((row) => ({name: row.querySelector(".lora-use").value,
                    scale: Number(row.querySelector(".lora-scale").value)}));
}

function request() {
  const body = {prompt: $("prompt").value, size: $("width").value + "x" + $("height").value};
  if ($("negative_prompt").value) body.negative_prompt = $("negative_prompt").value;
  for (const name of ["steps", "guidance", "seed"]) {
    if ($(name).value !== "") body[name] = Number($(name).value);
  }
  const loras = chosenLoras();
  if (loras.length) body.loras = loras;
  return body;
}

// POST /v1/jobs (JSON), or with an image POST /v1/jobs/edits (multipart: the image, mask and strength too)
function submission() {
  const body = request();
  const image = $("image").files[0];
  if (!image) {
    return ["/v1/jobs", {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)}];
  }
  const form = new FormData();
  for (const [name, value] of Object.entries(body)) form.append(name, name === "loras" ? JSON.stringify(value) : value);
  form.append("image", image);
  if ($("mask").files[0]) form.append("mask", $("mask").files[0]);
  if ($("strength").value !== "") form.append("strength", $("strength").value);
  return ["/v1/jobs/edits", {method: "POST", body: form}];
}

function describe(job) {
  const p = job.parameters;
  return `${job.prompt}\nseed ${job.seeds.join(", ")} · ${p.steps} steps · guidance ${p.guidance}` +
    (p.negative_prompt ? `\nnegative: ${p.negative_prompt}` : "") + (p.loras ? `\nLoRAs: ${p.loras}` : "") +
    (p.image ? `\nfrom ${p.image}` + (p.mask ? `, mask ${p.mask}` : "") + (p.strength ? `, strength ${p.strength}` : "")
      : "");
}

async function* events(jobId) {
  const response = await fetch(`/v1/jobs/${jobId}/events`, {headers: headers()});
  if (!response.ok) throw new Error("event stream: " + response.statusText);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const name = (block.match(/^event: (.*)$/m) || [])[1];
      const data = (block.match(/^data: (.*)$/m) || [])[1];
      if (name) yield [name, JSON.parse(data)];
    }
  }
}

async function follow(job, card) {
  const q = (cls) => card.querySelector("." + cls);
  card.dataset.jobId = job.id;
  q("params").textContent = describe(job);
  q("cancel").onclick = () => api(`/v1/jobs/${job.id}/cancel`, {method: "POST"}).catch((e) => {
    q("error").textContent = e.message;
  });
  for await (const [name, data] of events(job.id)) {
    card.dataset.status = name;
    if (name === "started") q("status").textContent = "running";
    if (name === "progress") {
      q("status").textContent = `step ${data.step} of ${data.steps}` +
        (data.images > 1 ? ` (image ${data.image + 1} of ${data.images})` : "");
      q("bar").value = (data.image * data.steps + data.step) / (data.images * data.steps);
      card.dataset.lastStep = data.step;
      if (data.preview) q("preview").src = "data:image/png;base64," + data.preview;
    }
    if (name === "done") {
      const blob = await (await fetch(data.images[0], {headers: headers()})).blob();
      const url = URL.createObjectURL(blob);
      q("result").src = url;
      q("result").hidden = false;
      q("preview").hidden = true;
      q("download").href = url;
      q("download").download = `mlxdiff-${job.seeds[0]}.png`;
      q("download").hidden = false;
      q("bar").value = 1;
      q("status").textContent = "done";
      q("cancel").hidden = true;
    }
    if (name === "error" || name === "cancelled") {
      q("status").textContent = name;
      q("error").textContent = data.message || "";
      q("cancel").hidden = true;
    }
  }
}

$("form").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("form-error").textContent = "";
  localStorage.setItem("mlxdiff-api-key", $("api_key").value);
  try {
    const job = await api(...submission());
    const card = $("job-template").content.firstElementChild.cloneNode(true);
    $("jobs").prepend(card);
    follow(job, card).catch((e) => { card.querySelector(".error").textContent = e.message; });
  } catch (e) {
    $("form-error").textContent = e.message;
  }
});

configure().catch((e) => { $("form-error").textContent = e.message; });
