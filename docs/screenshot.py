"""Regenerate docs/screenshot.png: a question about assets/sample.png at a given speed in the web chat.

    glimpse serve --port 7860 &          # any model; the README's shot uses the embedded one
    python docs/screenshot.py http://127.0.0.1:7860 docs/screenshot.png [POLICY] [SPEED] [QUESTION]

Defaults: auto at speed 1, "What colour is the circle?" (the README's first question).
"""

import shutil
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

url, out = sys.argv[1], sys.argv[2]
policy = sys.argv[3] if len(sys.argv) > 3 else "auto"
speed = sys.argv[4] if len(sys.argv) > 4 else "1"
question = sys.argv[5] if len(sys.argv) > 5 else "What colour is the circle?"
with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    page.wait_for_selector("#input textarea", timeout=60_000)
    if policy != "auto":  # auto is already selected
        page.locator("#policy input").click()
        page.get_by_role("option", name=policy, exact=True).click()
    page.locator("#speed input[type=number]").fill(speed)
    page.locator("#speed input[type=number]").press("Enter")
    page.get_by_text("also run unpruned, to compare").click()
    page.locator("#input input[type=file]").set_input_files(str(Path(__file__).parents[1] / "assets" / "sample.png"))
    page.wait_for_selector("#input .thumbnail-item", timeout=30_000)
    page.locator("#input textarea").fill(question)
    page.locator("#input textarea").press("Enter")
    page.wait_for_function("document.querySelector('#metrics').innerText.includes('unpruned; time to first token')", timeout=300_000)
    # That first answer warmed the model up; the shot shows a regenerated one.
    first = page.locator("#metrics").inner_text()
    page.locator("#chat button[aria-label='Retry']").last.click()
    page.wait_for_function("old => { const t = document.querySelector('#metrics').innerText; "
                           "return t !== old && t.includes('unpruned; time to first token'); }", arg=first, timeout=300_000)
    # The metrics may change before the chat is done (a shot once caught "processing" over a greyed-out table).
    page.wait_for_function("!document.body.innerText.includes('processing |')", timeout=300_000)
    page.wait_for_timeout(3000)
    page.screenshot(path=out, full_page=True)
    browser.close()
