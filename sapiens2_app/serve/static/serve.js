// The page of serve.py: photos in, each task's pictures out, an attention explorer. It uses only the HTTP API of
// docs/serve.md (the one scripts use), no library and nothing from another site.
"use strict";

// The pictures among a photo's files, in the order they are shown (the other files are downloads only)
const PICTURES = [
  [".seg_overlay.jpg", "segmentation"], [".pose_overlay.jpg", "pose (hover a point)"], [".normal.png", "normals"],
  [".depth.png", "depth, from the pointmap"], [".composite.jpg", "matting"], [".albedo.png", "albedo"],
];
const KEYPOINT_SHOWN = 0.3; // the score above which the pose picture draws a keypoint (pictures.draw_pose)
const POLL_MS = 1000;

let health = null;
const $ = (selector, root = document) => root.querySelector(selector);

function element(tag, properties = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, properties);
  node.append(...children);
  return node;
}

async function api(path, options) {
  const response = await fetch(path, options);
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new Error((body && body.error) || `${response.status} ${response.statusText}`);
  return body;
}

function showMessage(text) {
  const message = $("#message");
  message.hidden = !text;
  message.textContent = text || "";
}

// ----- start: what the server runs ------------------------------------------------------------------------------
async function start() {
  try {
    health = await api("/api/health");
  } catch (error) {
    showMessage(`cannot reach the server: ${error.message}`);
    return;
  }
  const sources = Object.entries(health.models).map(([task, m]) => `${task}: ${m.source}${m.random_weights ? " (random)" : ""}`);
  $("#models").textContent = `${sources.join(" · ")} · ${health.device}, ${health.dtype}`;
  if (health.banner) {
    const banner = $("#banner");
    banner.hidden = false;
    banner.textContent = health.banner.split("\n").filter((line) => line.startsWith("!!  "))
      .map((line) => line.slice(4)).join(" ");
  }
  const fieldset = $("#tasks");
  for (const task of health.tasks) {
    const box = element("input", { type: "checkbox", name: "task", value: task, checked: task !== "features" });
    fieldset.append(element("label", {}, box, ` ${task}`));
  }
  const input = $("#photos");
  input.addEventListener("change", updateChosen);
  const drop = $("#drop");
  drop.addEventListener("dragover", (event) => { event.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    input.files = event.dataTransfer.files;
    updateChosen();
  });
  $("#upload-form").addEventListener("submit", (event) => { event.preventDefault(); submit(); });
}

function updateChosen() {
  const files = [...$("#photos").files];
  $("#chosen").textContent = files.length ? `${files.length} photo${files.length > 1 ? "s" : ""}` : "";
  $("#run").disabled = !files.length;
}

async function submit() {
  const files = [...$("#photos").files];
  const tasks = [...document.querySelectorAll("#tasks input:checked")].map((box) => box.value);
  const total = files.reduce((sum, file) => sum + file.size, 0) / 2 ** 20;
  if (!tasks.length) return showMessage("choose at least one task");
  if (files.length > health.limits.max_images) return showMessage(`at most ${health.limits.max_images} photos at once`);
  if (total > health.limits.max_upload_mb) {
    return showMessage(`${total.toFixed(1)} MB of photos: this server takes at most ${health.limits.max_upload_mb} MB at once`);
  }
  const form = new FormData();
  files.forEach((file) => form.append("image", file, file.name));
  form.append("tasks", tasks.join(","));
  showMessage("");
  $("#run").disabled = true;
  try {
    const { id } = await api("/api/jobs", { method: "POST", body: form });
    addJob(id, files, tasks);
  } catch (error) {
    showMessage(error.message);
  } finally {
    $("#run").disabled = !files.length;
  }
}

// ----- a job: its photos' cards, kept up to date from the server ---------------------------------------------------
function addJob(id, files, tasks) {
  const state = element("span", { className: "state queued", textContent: "queued" });
  const zip = element("a", { href: `/api/jobs/${id}/zip`, download: "sapiens2-results.zip", textContent: "download all (zip)", hidden: true });
  const section = element("section", { className: "job" },
    element("header", {}, element("strong", { textContent: `job ${id.slice(0, 8)}` }),
      element("span", { className: "muted", textContent: tasks.join(", ") }), state, zip));
  const job = { id, tasks, section, state, zip, cards: [], finished: false };
  files.forEach((file) => {
    const card = $("#photo-template").content.firstElementChild.cloneNode(true);
    $(".name", card).textContent = file.name;
    $(".input img", card).src = URL.createObjectURL(file);
    section.append(card);
    job.cards.push({ card, shown: false });
  });
  $("#jobs").prepend(section);
  follow(job);
}

function follow(job) {
  if (!window.EventSource) return poll(job);
  const events = new EventSource(`/api/jobs/${job.id}/events`);
  events.onmessage = (event) => {
    render(job, JSON.parse(event.data));
    if (job.finished) events.close();
  };
  events.onerror = () => {
    events.close();
    if (!job.finished) poll(job);
  };
}

async function poll(job) {
  while (!job.finished) {
    try {
      render(job, await api(`/api/jobs/${job.id}`));
    } catch (error) {
      job.state.textContent = error.message;
      return;
    }
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
  }
}

function render(job, status) {
  job.finished = status.state === "done" || status.state === "failed";
  job.state.className = `state ${status.state}`;
  job.state.textContent = status.state + (status.error ? `: ${status.error}` : "");
  job.zip.hidden = !(job.finished && Object.keys(status.files).length);
  status.images.forEach((image, index) => {
    const entry = job.cards[index];
    const card = entry.card;
    $(".state", card).className = `state ${image.state}`;
    $(".state", card).textContent = image.state;
    const errors = [image.error, ...Object.entries(image.task_errors).map(([task, why]) => `${task}: ${why}`)];
    $(".error", card).textContent = errors.filter(Boolean).join("; ");
    if (image.state === "done" && !entry.shown) {
      entry.shown = true;
      showResults(card, image, status);
      setUpAttention(card, job, index);
    }
  });
}

function showResults(card, image, status) {
  const results = $(".results", card);
  for (const [suffix, label] of PICTURES) {
    const name = image.files.find((file) => file.endsWith(suffix));
    if (!name) continue;
    const file = status.files[name];
    const img = element("img", { src: file.url, alt: label, className: "result" });
    const link = element("a", { href: file.url, download: name, textContent: "download" });
    results.append(element("figure", {}, img, element("figcaption", {}, `${label} · `, link)));
    if (suffix === ".pose_overlay.jpg") {
      const json = status.files[name.slice(0, -suffix.length) + ".pose.json"];
      if (json) namePointsOnHover(img, json.url);
    }
  }
  const list = $(".downloads ul", card);
  for (const name of image.files) {
    const file = status.files[name];
    list.append(element("li", {}, element("a", { href: file.url, download: name, textContent: name }),
      ` (${(file.bytes / 1024).toFixed(0)} KB)`));
  }
}

// Hovering the pose picture names the nearest keypoint it draws (pose.json: keypoints in photo pixels)
async function namePointsOnHover(img, url) {
  const pose = await api(url);
  const tooltip = $("#tooltip");
  img.addEventListener("mousemove", (event) => {
    const box = img.getBoundingClientRect();
    const scale = pose.width / box.width;
    const x = (event.clientX - box.left) * scale, y = (event.clientY - box.top) * scale;
    let best = null, bestDistance = 12 * scale; // within 12 screen pixels
    for (const person of pose.people) {
      person.keypoints.forEach(([kx, ky, score], k) => {
        const distance = Math.hypot(kx - x, ky - y);
        if (score > KEYPOINT_SHOWN && distance < bestDistance) { best = k; bestDistance = distance; }
      });
    }
    tooltip.hidden = best === null;
    if (best !== null) {
      tooltip.textContent = pose.keypoint_names[best];
      tooltip.style.left = `${event.clientX + 12}px`;
      tooltip.style.top = `${event.clientY + 12}px`;
    }
  });
  img.addEventListener("mouseleave", () => { tooltip.hidden = true; });
}

// ----- the attention explorer ------------------------------------------------------------------------------------
function setUpAttention(card, job, index) {
  const section = $(".attention", card);
  const view = { task: job.tasks[0], query: "cls", grid: null, asked: 0 };
  const taskSelect = $(".att-task", section), block = $(".att-block", section), head = $(".att-head", section);
  const map = $(".att-map", section), caption = $(".att-caption", section);
  for (const task of job.tasks) taskSelect.append(element("option", { value: task, textContent: task }));

  function configure() {
    const model = health.models[view.task];
    block.max = model.depth - 1;
    block.value = model.depth - 1;
    $(".att-block-value", section).value = block.value;
    head.replaceChildren(element("option", { value: "mean", textContent: "mean of heads" }),
      ...Array.from({ length: model.heads }, (_, h) => element("option", { value: h, textContent: `head ${h}` })));
    const queries = $(".att-queries", section);
    queries.replaceChildren(queryButton("cls", "CLS"),
      ...Array.from({ length: model.registers }, (_, r) => queryButton(`register:${r}`, `reg ${r}`)));
    view.query = "cls";
    drawNorms();
    show();
  }

  function queryButton(query, label) {
    const button = element("button", { type: "button", className: "query", textContent: label });
    button.dataset.query = query;
    button.addEventListener("click", () => { view.query = query; show(); });
    return button;
  }

  async function show() {
    const asked = ++view.asked; // a newer request wins over a slower older one
    for (const button of section.querySelectorAll(".query")) button.classList.toggle("on", button.dataset.query === view.query);
    const query = new URLSearchParams({ image: index, task: view.task, block: block.value, head: head.value, query: view.query });
    try {
      const row = await api(`/api/jobs/${job.id}/attention?${query}`);
      if (asked !== view.asked) return;
      view.grid = [row.rows, row.cols];
      map.src = row.png;
      caption.textContent = `block ${row.block} of ${row.depth}, ${row.head === "mean" ? "mean of heads" : "head " + row.head}, ` +
        `query ${row.query} (token ${row.token}); grid ${row.rows}x${row.cols}: click a patch`;
      caption.classList.remove("error");
    } catch (error) {
      caption.textContent = error.message;
      caption.classList.add("error");
    }
  }

  async function drawNorms() {
    const svg = $("svg.norms", section);
    try {
      plotNorms(svg, await api(`/api/jobs/${job.id}/norms?${new URLSearchParams({ image: index, task: view.task })}`));
    } catch (error) {
      svg.replaceChildren(svgElement("text", { x: 10, y: 20 }, error.message));
    }
  }

  map.addEventListener("click", (event) => {
    if (!view.grid) return;
    const [rows, cols] = view.grid;
    const row = Math.min(rows - 1, Math.floor(event.offsetY / map.clientHeight * rows));
    const col = Math.min(cols - 1, Math.floor(event.offsetX / map.clientWidth * cols));
    view.query = `patch:${row},${col}`;
    show();
  });
  block.addEventListener("input", () => { $(".att-block-value", section).value = block.value; });
  block.addEventListener("change", show);
  head.addEventListener("change", show);
  taskSelect.addEventListener("change", () => { view.task = taskSelect.value; configure(); });
  section.hidden = false;
  configure();
}

// Token norms per block as lines: CLS, each register, the patches' mean and max
function plotNorms(svg, norms) {
  const width = 420, height = 240, left = 40, right = 110, top = 10, bottom = 30;
  const series = [
    { name: "CLS", color: "#d62728", values: norms.cls },
    ...Array.from({ length: norms.registers }, (_, r) => ({
      name: r === 0 ? "registers" : null, color: "#9467bd", thin: true, values: norms.register_norms.map((block) => block[r]) })),
    { name: "patches (mean)", color: "#1f77b4", values: norms.patches_mean },
    { name: "patches (max)", color: "#17becf", dashed: true, values: norms.patches_max },
  ];
  // a log scale: a register's or the CLS token's norm may be a hundredth of the patches' (or a hundred times)
  const values = series.flatMap((line) => line.values).filter((value) => value > 0);
  const low = Math.min(...values) / 1.25, high = Math.max(...values) * 1.25;
  const x = (block) => left + (norms.depth > 1 ? block / (norms.depth - 1) : 0.5) * (width - left - right);
  const y = (value) => top + (1 - Math.log(Math.max(value, low) / low) / Math.log(high / low)) * (height - top - bottom);
  const parts = [
    svgElement("line", { x1: left, y1: y(low), x2: width - right, y2: y(low), stroke: "#999" }),
    svgElement("line", { x1: left, y1: top, x2: left, y2: y(low), stroke: "#999" }),
    svgElement("text", { x: left - 4, y: top + 8, "text-anchor": "end" }, high.toPrecision(2)),
    svgElement("text", { x: left - 4, y: y(low), "text-anchor": "end" }, low.toPrecision(2)),
    svgElement("text", { x: left - 4, y: (top + y(low)) / 2, "text-anchor": "end" }, "log"),
    svgElement("text", { x: (left + width - right) / 2, y: height - 8, "text-anchor": "middle" }, `block (0..${norms.depth - 1})`),
  ];
  let legend = top + 10;
  for (const line of series) {
    const points = line.values.map((value, block) => `${x(block).toFixed(1)},${y(value).toFixed(1)}`).join(" ");
    parts.push(svgElement("polyline", { points, fill: "none", stroke: line.color, "stroke-width": line.thin ? 1 : 2,
      "stroke-dasharray": line.dashed ? "4 3" : "none", "stroke-opacity": line.thin ? 0.6 : 1 }));
    if (line.name) {
      parts.push(svgElement("line", { x1: width - right + 6, y1: legend - 3, x2: width - right + 20, y2: legend - 3, stroke: line.color, "stroke-width": 2 }));
      parts.push(svgElement("text", { x: width - right + 24, y: legend }, line.name));
      legend += 14;
    }
  }
  svg.replaceChildren(...parts);
}

function svgElement(tag, attributes, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

start();
