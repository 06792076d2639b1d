// A small hand-written canvas line chart for the dashboard: a few series over the last minutes, no library.
"use strict";

class LiveChart {
  // series: [{name, color}]; windowS: seconds shown (older points are dropped, so memory stays bounded)
  constructor(canvas, series, windowS = 180) {
    this.canvas = canvas;
    this.ctx = canvas.getContext("2d");
    this.series = series;
    this.windowS = windowS;
    this.points = [];  // [t, [v per series]]
  }

  push(t, values) {
    this.points.push([t, values]);
    while (this.points.length && this.points[0][0] < t - this.windowS) this.points.shift();
  }

  draw() {
    const { ctx, canvas } = this, w = canvas.width, h = canvas.height, pad = 14;
    ctx.clearRect(0, 0, w, h);
    if (!this.points.length) return;
    const tEnd = this.points[this.points.length - 1][0], tStart = tEnd - this.windowS;
    let max = 1;
    for (const [, vs] of this.points) for (const v of vs) if (v > max) max = v;
    ctx.strokeStyle = "#262c35";
    ctx.beginPath(); ctx.moveTo(0, h - pad + 0.5); ctx.lineTo(w, h - pad + 0.5); ctx.stroke();
    ctx.font = "10px sans-serif";
    ctx.fillStyle = "#8a94a3";
    ctx.fillText(String(Math.round(max * 10) / 10), 2, 10);
    ctx.fillText(`-${Math.round(this.windowS / 60)} min`, 2, h - 2);
    this.series.forEach((s, i) => {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      this.points.forEach(([t, vs], j) => {
        const x = ((t - tStart) / this.windowS) * w, y = h - pad - (vs[i] / max) * (h - pad - 14);
        if (j === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      });
      ctx.stroke();
      const last = this.points[this.points.length - 1][1][i];
      ctx.fillStyle = s.color;
      const label = `${s.name} ${Math.round(last * 10) / 10}`;
      ctx.fillText(label, w - 6 - ctx.measureText(label).width, 10 + 11 * i);
    });
  }
}
window.LiveChart = LiveChart;
