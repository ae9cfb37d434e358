// Run page: tick two versions, then Compare opens /runs/<run>/diff?a=<older>&b=<newer>.
// Without this script the form still works: it sends ?v=3&v=5 and the server orders them.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  const form = document.getElementById("compare");
  if (!form) return;
  const button = document.getElementById("compare-button");
  const hint = document.getElementById("compare-hint");
  const boxes = Array.from(form.querySelectorAll('input[type="checkbox"][name="v"]'));
  const ticked = () => boxes.filter((box) => box.checked);

  function update() {
    const picked = ticked();
    button.disabled = picked.length !== 2;
    for (const box of boxes) {
      box.disabled = picked.length >= 2 && !box.checked;
      box.closest("tr").classList.toggle("picked", box.checked);
    }
    hint.textContent = picked.length === 2
      ? `Compare v${picked.map((b) => b.value).sort((x, y) => x - y).join(" with v")}.`
      : `Tick ${2 - picked.length} more version${picked.length === 1 ? "" : "s"} to compare.`;
  }

  form.addEventListener("change", update);
  form.addEventListener("submit", (event) => {
    const picked = ticked().map((box) => Number(box.value)).sort((x, y) => x - y);
    event.preventDefault();
    if (picked.length !== 2) return;
    const query = new URLSearchParams({ a: String(picked[0]), b: String(picked[1]) });
    window.location.assign(`${form.getAttribute("action")}?${query}`);
  });
  update();
});

// Version page: a Copy button beside each snippet (without this script the text is still there to select).
document.addEventListener("DOMContentLoaded", () => {
  if (!navigator.clipboard) return;  // only on https or localhost
  for (const figure of document.querySelectorAll("figure.snippet")) {
    const code = figure.querySelector("pre");
    const caption = figure.querySelector("figcaption");
    if (!code || !caption) continue;
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "Copy";
    button.addEventListener("click", () => {
      navigator.clipboard.writeText(code.innerText).then(
        () => { button.textContent = "Copied"; },
        () => { button.textContent = "Select the text to copy"; },
      );
    });
    caption.append(button);
  }
});

// Runs page: tick 2 to 8 runs, then Compare runs opens /compare?run=a&run=b…
// Without this script the form still sends the ticked runs; the server refuses fewer than 2 or more than 8.
document.addEventListener("DOMContentLoaded", () => {
  const form = document.getElementById("compare-runs");
  if (!form) return;
  const button = document.getElementById("compare-runs-button");
  const hint = document.getElementById("compare-runs-hint");
  const most = 8;
  const boxes = Array.from(form.querySelectorAll('input[type="checkbox"][name="run"]'));

  function update() {
    const picked = boxes.filter((box) => box.checked);
    button.disabled = picked.length < 2;
    for (const box of boxes) {
      box.disabled = picked.length >= most && !box.checked;
      box.closest("tr").classList.toggle("picked", box.checked);
    }
    if (picked.length < 2) {
      hint.textContent = `Tick ${2 - picked.length} more run${picked.length === 1 ? "" : "s"} to compare (at most ${most}).`;
    } else {
      hint.textContent = `Compare ${picked.length} runs${picked.length >= most ? ` (${most} at most)` : ""}.`;
    }
  }

  form.addEventListener("change", update);
  update();
});
